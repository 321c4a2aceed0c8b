"""The overlap schedule's bookkeeping (placeholders, deferred finishes, aborts and retractions
while a step is in flight) on the CPU, through the eager launch path.

On a GPU the launch replays a CUDA graph and nothing waits for the device until the next
step; here the forward has already run when `launch` returns, but every decision the engine
makes about the step in flight is the same, so its outputs must equal the synchronous
engine's exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.engine.runner import PLACEHOLDER  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402

PS = 8


def make(ckpt, model, overlap: bool, **kw) -> Engine:
    kw.setdefault("page_size", PS)
    e = Engine(EngineConfig(model=ckpt, **kw), model=model, log=lambda *a: None)
    e.overlap = overlap
    e.runner.eager_async = overlap
    return e


def toks(seed, n):
    g = random.Random(seed)
    return [g.randrange(1, 900) for _ in range(n)]


def drive(e: Engine, prompts, params) -> tuple[list, list, int]:
    """Run to completion, collecting the streamed outputs; -> (completions, streams, async steps)."""
    rids = [e.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
    streams = {r: [] for r in rids}
    async_steps = 0
    while e.has_work():
        for out in e.step():
            streams[out.rid].append((out.new_token_ids[0], out.finished, out.finish_reason, out.completion_tokens))
        async_steps += e._inflight is not None
        e.check_invariants()
        for r in rids:  # no placeholder is ever visible once its step has been read
            req = e.requests[r]
            assert PLACEHOLDER not in req.output_ids[:-1]
    comps = [e.requests.pop(r) for r in rids]
    return [(c.output_ids, c.finish_reason) for c in comps], [streams[r] for r in rids], async_steps


def test_overlap_equals_sync_with_stops_lengths_and_min_tokens(ckpt, model):
    prompts = [toks(i, n) for i, n in enumerate([3, 17, 40, 9, 25])]
    probe = make(ckpt, model, False)
    first = [c[0] for c in drive(probe, prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 5)[0]]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[1][2]]),          # stops at 3
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[2][0]], min_tokens=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),                       # ends on its first
        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first[4][4]]),          # stop == length
    ]
    want, want_stream, n_async = drive(make(ckpt, model, False), prompts, params)
    assert n_async == 0
    got, got_stream, n_async = drive(make(ckpt, model, True), prompts, params)
    assert n_async > 0, "no step was overlapped"
    assert got == want
    assert got_stream == want_stream
    assert got[1][1] == "stop" and len(got[1][0]) == 3


def test_overlap_random_traffic_with_aborts_and_retractions(ckpt, model):
    """Tight pools, random aborts, greedy and seeded sampled rows mixed: invariants at every
    step, pools empty at the end, and every finished request's tokens equal the synchronous
    engine's."""
    rng = random.Random(0)
    shared = [toks(1000 + i, 24) for i in range(3)]
    script, submitted = [], 0  # the traffic is fixed up front: the same in both runs
    while submitted < 160:
        arrivals = []
        for _ in range(rng.randrange(0, 8)):
            prompt = (rng.choice(shared)[: rng.randrange(0, 24)] if rng.random() < 0.6 else []) \
                + toks(submitted, rng.randrange(1, 10))
            params = SamplingParams(temperature=rng.choice([0.0, 0.0, 0.0, 1.0]), max_tokens=rng.randrange(1, 14),
                                    ignore_eos=True, seed=rng.randrange(100))
            arrivals.append((f"r{submitted}", prompt, params))
            submitted += 1
        abort = f"r{rng.randrange(submitted)}" if submitted and rng.random() < 0.05 else None
        script.append((arrivals, abort))
    aborted = {a for _, a in script if a}

    def traffic(overlap: bool):
        e0 = make(ckpt, model, False)
        lay = e0.layout
        budget = 24 * lay.state_bytes_per_slot + 12 * lay.kv_bytes_per_page
        e = make(ckpt, model, overlap, max_mamba_cache_size=24, cache_memory_gb=budget / 2**30,
                 state_checkpoint_interval=8, chunked_prefill_size=16, max_prefill_tokens=48)
        done, async_steps, i = {}, 0, 0
        while i < len(script) or e.has_work():
            if i < len(script):
                arrivals, abort = script[i]
                for rid, prompt, params in arrivals:
                    e.add_request(prompt, params, rid=rid)
                if abort:
                    e.abort(abort)
                i += 1
            e.step()
            async_steps += e._inflight is not None
            e.check_invariants()
            for rid in [r for r, q in e.requests.items() if q.finished]:
                q = e.requests.pop(rid)
                if q.finish_reason != "abort":
                    done[rid] = (q.params.temperature, q.output_ids, q.finish_reason)
        e.flush_cache()
        e.check_invariants()
        assert e.pages.num_free == e.pages.num_pages and e.slots.num_free == e.slots.num_slots
        return done, e.counters["retractions"], async_steps

    want, _, _ = traffic(False)
    got, retractions, async_steps = traffic(True)
    assert async_steps >= 10 and retractions > 0
    both = (set(want) & set(got)) - aborted
    assert len(both) > 60
    for rid in both:  # sampled rows too: the overlapped draw is the synchronous one
        assert got[rid] == want[rid], rid


def test_the_step_body_changes_only_between_steps_in_flight(ckpt, model):
    """`overlap` picks the step body; switching it while a launched step's tokens are unread
    would strand them, so it is refused until the step in flight has been read."""
    e = make(ckpt, model, True)
    assert e.overlap
    e.add_request(toks(5, 6), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while e._inflight is None:
        e.step()
    with pytest.raises(RuntimeError):
        e.overlap = False
    while e.has_work():
        e.step()
    e.overlap = False
    assert not e.overlap and e._step_body == e._normal_step


def test_an_abort_after_the_final_output_changes_nothing(ckpt, model):
    """With a step in flight a finished request is only `finishing` (its slot still in use);
    its end has gone out, so an abort arriving then (a client that left at the last token) is
    refused: the finish reason, the counters and the end-of-request checkpoint stay."""
    p = toks(1, 10)
    first = make(ckpt, model, False).generate([p], SamplingParams(temperature=0, max_tokens=6,
                                                                 ignore_eos=True))[0][0].output_ids
    e = make(ckpt, model, True)
    a = e.add_request(p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first[3]]))[0]
    e.add_request(toks(2, 12), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen = False
    while e.has_work():
        if any(o.rid == a and o.finished for o in e.step()):
            assert e.requests[a].finishing is not None  # the case: its slot still in use by a step
            assert not e.abort(a)
            seen = True
    assert seen and e.requests[a].finish_reason == "stop"
    assert e.counters["aborted"] == 0 and e.counters["finished"] == 2
    e.check_invariants()


def test_a_request_whose_last_token_is_in_flight_is_not_planned_again(ckpt, model):
    """The launched step carries a request's last token (by max_tokens): the next plan has
    nothing to run for it (no 0-token Work sampled from a stale state, which would also force
    that step off the overlapped path)."""
    e = make(ckpt, model, True)
    planned_empty, schedule = [], e.scheduler.schedule

    def watch():
        plan = schedule()
        planned_empty.extend(w.req.rid for w in plan.work if w.num == 0 and w.req.output_ids)
        return plan
    e.scheduler.schedule = watch
    rids = [e.add_request(toks(i, 10), SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True))[0]
            for i in range(3)]
    while e.has_work():
        e.step()
    assert planned_empty == []
    assert [len(e.requests[r].output_ids) for r in rids] == [4, 7, 10]
    e.check_invariants()
