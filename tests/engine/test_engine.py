"""The in-process engine on the tiny model (CPU, fp32, reference backend).

Invariance: a request's greedy tokens are the same alone, batched with others, with any
chunk size, after every kind of prefix-cache hit and after retraction. Each compared step's
top-2 logprob margin is checked so a near-tie is reported instead of flaking.
"""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import ContextLengthExceeded, Engine  # noqa: E402
from glmrt.engine.warmup import warm_prefill  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402

MIN_MARGIN = 1e-4  # 10x the largest logit difference seen between batchings (~1e-5)
PS = 8  # small pages: many page boundaries in short prompts


def make(ckpt, model, **kw) -> Engine:
    kw.setdefault("page_size", PS)
    return Engine(EngineConfig(model=ckpt, **kw), model=model, log=lambda *a: None)


def greedy(n=10, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2, **kw)


def toks(seed, n):
    g = random.Random(seed)
    return [g.randrange(1, 900) for _ in range(n)]


def run(engine, prompts, params=None):
    outs = engine.generate(prompts, params or greedy())
    engine.check_invariants()
    return [c[0] for c in outs]


def assert_same(got, want):
    """Equal tokens, and every compared step decided by a clear margin in the reference."""
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g.output_ids, w.output_ids)):
            top = w.top_logprobs[i]
            margin = top[0][1] - top[1][1]
            assert margin > MIN_MARGIN, f"near-tie at step {i} (margin {margin:.2e}): comparison not meaningful"
            assert a == b, f"token {i} differs: {a} != {b}"
        assert len(g.output_ids) == len(w.output_ids)


@pytest.fixture(scope="module")
def reference(ckpt, model):
    """Each prompt alone, no prefix cache."""
    e = make(ckpt, model, disable_radix_cache=True)

    def ref(prompt, n=10):
        return run(e, [prompt], greedy(n))[0]
    return ref


def test_batch_and_chunk_invariance(ckpt, model, reference):
    prompts = [toks(i, n) for i, n in enumerate([3, 17, 40, 64, 9])]
    want = [reference(p) for p in prompts]
    for chunk in (1, 5, 16, 1000):
        e = make(ckpt, model, chunked_prefill_size=chunk, disable_radix_cache=True)
        assert_same(run(e, prompts), want)


def test_a_token_budget_per_step_keeps_the_tokens(ckpt, model):
    """--max-num-batched-tokens changes how prompts are cut into steps beside the decodes, never
    the tokens: 48 bites while the long prompts prefill; 4 falls below the decode batch, whose
    steps then alternate between decodes alone and decodes + the starvation floor (4 tokens)."""
    prompts = [toks(50 + i, n) for i, n in enumerate([2, 3, 2, 3, 2, 40, 30])]
    want = run(make(ckpt, model, disable_radix_cache=True), prompts)
    for cap in (48, 4):
        e = make(ckpt, model, max_num_batched_tokens=cap, disable_radix_cache=True)
        steps, schedule = [], e.scheduler.schedule

        def record():   # (decode tokens, prefill tokens) of each plan, as the scheduler counts them
            plan = schedule()
            decodes = sum(w.num for w in plan.work if w.req.num_uncomputed == 1)
            steps.append((decodes, plan.num_tokens - decodes))
            return plan
        e.scheduler.schedule = record
        assert_same(run(e, prompts), want)
        for (_, before), (d, p) in zip([(0, 1)] + steps, steps):
            # within the budget, decodes alone, or the floor right after a step without a prefill
            assert d + p <= cap or p == 0 or (p <= cap and before == 0), steps
        assert max(d + p for d, p in steps) == (48 if cap == 48 else 5 + 4), steps


def test_prefix_hits_full_partial_and_divergence(ckpt, model, reference):
    e = make(ckpt, model)
    system = toks(100, 45)  # not page-aligned
    a, b, c = (system + toks(101 + i, 7 + i) for i in range(3))
    ra = run(e, [a])[0]
    assert ra.cached_tokens == 0
    assert_same([ra], [reference(a)])
    rb = run(e, [b])[0]   # shares `system` with a: hits an earlier checkpoint at most, splits a's path
    assert_same([rb], [reference(b)])
    rc = run(e, [c])[0]   # third sharer: hits the divergence checkpoint saved by b at len(system)
    assert rc.cached_tokens == len(system)
    assert_same([rc], [reference(c)])
    # multi-turn: the next prompt extends a finished request's tokens -> hit at its end
    turn2 = a + ra.output_ids + toks(200, 6)
    r2 = run(e, [turn2])[0]
    assert r2.cached_tokens == len(a) + len(ra.output_ids) - 1
    assert_same([r2], [reference(turn2)])
    # an exact repeat of a cached prompt is a full hit: nothing computed, the same tokens
    rr = run(e, [a])[0]
    assert rr.cached_tokens == len(a)
    assert_same([rr], [ra])


def test_interval_checkpoints_on_and_off_page_boundaries(ckpt, model, reference):
    e = make(ckpt, model, state_checkpoint_interval=12)  # 12, 24, 36: on and off the 8-token pages
    base = toks(300, 50)
    run(e, [base])
    for cut, expect in ((26, 24), (40, 36), (17, 12)):
        p = base[:cut] + toks(301 + cut, 5)
        r = run(e, [p])[0]
        assert r.cached_tokens == expect
        assert_same([r], [reference(p)])


def test_shared_prefix_uses_lp_plus_n_ls_pages(ckpt, model):
    e = make(ckpt, model)
    lp, ls, n = 64, 16, 6
    system = toks(400, lp)
    run(e, [system + toks(401, ls)])  # prime: the prefix and its pages are cached
    run(e, [system + toks(402, ls)])  # saves the divergence checkpoint at lp
    e.flush_cache()
    run(e, [system + toks(401, ls)])
    run(e, [system + toks(402, ls)])
    base_used = e.pages.num_used
    prompts = [system + toks(410 + i, ls) for i in range(n)]
    rids = [e.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0] for p in prompts]
    e.step()
    held = set()
    for rid in rids:
        held.update(e.requests[rid].pages)
    tree_pages = set()
    stack = [e.tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        tree_pages.update(node.pages)
    private = held - tree_pages
    # every request computed only its suffix: shared prefix pages + about Ls/PS own pages each
    assert all(e.requests[r].cached_tokens == lp for r in rids)
    assert len(private) <= n * (-(-ls // PS) + 1)
    assert len(held & tree_pages) <= lp // PS + n * (ls // PS)
    while e.has_work():
        e.step()
    e.check_invariants()
    # the tree keeps the shared prefix once: each request adds only its suffix's full pages
    # and the partial page of the checkpoint at its end (one token past the last full page)
    assert e.pages.num_used == base_used + n * (ls // PS + 1)


def test_lpm_admits_longest_cached_prefix_first(ckpt, model):
    e = make(ckpt, model, schedule_policy="lpm", max_running_requests=1)
    long_prefix = toks(500, 40)
    run(e, [long_prefix + toks(501, 3)])
    run(e, [long_prefix + toks(502, 3)])  # divergence checkpoint at 40
    cold = e.add_request(toks(503, 20), greedy(2))[0]
    warm = e.add_request(long_prefix + toks(504, 5), greedy(2))[0]
    e.step()
    assert [r.rid for r in e.scheduler.running] == [warm]
    while e.has_work():
        e.step()
    assert e.requests[warm].cached_tokens == 40 and e.requests[cold].finished


def test_retraction_recompute_same_tokens(ckpt, model, reference):
    e0 = make(ckpt, model)
    lay = e0.layout
    # room for ~40 tokens of KV and plenty of slots: four requests growing to 28 tokens must retract
    budget = 64 * lay.state_bytes_per_slot + 5 * lay.kv_bytes_per_page
    e = make(ckpt, model, max_mamba_cache_size=64, cache_memory_gb=budget / 2**30, disable_radix_cache=True)
    prompts = [toks(600 + i, 12) for i in range(4)]
    got = run(e, prompts, greedy(16))
    assert e.counters["retractions"] > 0
    assert_same(got, [reference(p, 16) for p in prompts])


def test_seeded_sampling_is_batch_independent(ckpt, model):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = toks(700, 20)
    e = make(ckpt, model)
    alone = run(e, [prompt], p)[0].output_ids
    others = [toks(701 + i, 5 + 7 * i) for i in range(3)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    e2 = make(ckpt, model, chunked_prefill_size=7)
    outs = e2.generate([others[0], prompt, others[1], others[2]], [unseeded, p, unseeded, unseeded])
    assert outs[1][0].output_ids == alone


def test_n_choices_share_the_prefill(ckpt, model):
    e = make(ckpt, model)
    prompt = toks(800, 30)
    out = e.generate([prompt], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True))[0]
    e.check_invariants()
    assert len(out) == 3
    assert all(c.cached_tokens == len(prompt) for c in out[1:])
    assert len({tuple(c.output_ids) for c in out}) > 1  # different seeds per choice
    # a child forked from the parent's state equals a fresh request with the child's seed
    e2 = make(ckpt, model, disable_radix_cache=True)
    solo = e2.generate([prompt], SamplingParams(temperature=1.0, seed=6, max_tokens=6, ignore_eos=True))[0][0]
    assert out[1].output_ids == solo.output_ids


def test_choice_seeds_past_64_bits_wrap_and_the_engine_steps_on(ckpt, model):
    """A request may seed with 2^64 - 1 (the largest seed a generator takes): choice 1's seed + 1
    wraps to 0 instead of failing the step (and with it every request on the engine)."""
    e = make(ckpt, model)
    prompt = toks(850, 12)
    top = 2**64 - 1
    out = e.generate([prompt], SamplingParams(temperature=1.0, seed=top, n=2, max_tokens=4, ignore_eos=True))[0]
    assert [len(c.output_ids) for c in out] == [4, 4]
    zero = e.generate([prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=4, ignore_eos=True))[0][0]
    assert out[1].output_ids == zero.output_ids


def test_stop_conditions(ckpt, model):
    e = make(ckpt, model)
    prompt = toks(900, 10)
    first = run(e, [prompt], greedy(5))[0].output_ids
    r = run(e, [prompt], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first[2]]))[0]
    assert r.output_ids == first[:3] and r.finish_reason == "stop"
    r = run(e, [prompt], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first[0]], min_tokens=2))[0]
    assert len(r.output_ids) >= 2
    r = run(e, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert r.finish_reason == "length" and len(r.output_ids) == 4


def test_bad_input_is_refused(ckpt, model):
    e = make(ckpt, model)
    with pytest.raises(ValueError):
        e.add_request([], greedy())
    with pytest.raises(ValueError):
        e.add_request([5000], greedy())
    with pytest.raises(ContextLengthExceeded):
        e.add_request(list(range(1, 900)) * 1000, greedy())
    with pytest.raises(ValueError):
        e.add_request([1, 2], SamplingParams(temperature=-1))
    assert not e.has_work()


def test_leak_random_traffic_with_aborts_and_retractions(ckpt, model):
    """Random requests, random aborts, tight pools: invariants hold at every step, and after a
    cache flush both pools are exactly empty."""
    e0 = make(ckpt, model)
    lay = e0.layout
    budget = 24 * lay.state_bytes_per_slot + 12 * lay.kv_bytes_per_page
    e = make(ckpt, model, max_mamba_cache_size=24, cache_memory_gb=budget / 2**30, state_checkpoint_interval=8,
             chunked_prefill_size=16, max_prefill_tokens=48)
    rng = random.Random(0)
    shared = [toks(1000 + i, 24) for i in range(3)]
    live: list[str] = []
    submitted = 0
    steps = 0
    while submitted < 500 or e.has_work():
        for _ in range(rng.randrange(0, 12)):
            if submitted >= 500:
                break
            prompt = (rng.choice(shared)[: rng.randrange(0, 24)] if rng.random() < 0.6 else []) + toks(submitted, rng.randrange(1, 10))
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 14),
                                    ignore_eos=True, n=rng.choice([1, 1, 1, 2]), seed=rng.randrange(100))
            live += e.add_request(prompt, params)
            submitted += 1
        if live and rng.random() < 0.3:
            e.abort(live.pop(rng.randrange(len(live))))
        e.step()
        steps += 1
        e.check_invariants()
        for rid in [r for r in live if e.requests[r].finished]:
            live.remove(rid)
        for rid in [r for r, q in e.requests.items() if q.finished]:
            del e.requests[rid]
    assert e.counters["retractions"] > 0, "the pools were not tight enough to exercise retraction"
    e.flush_cache()
    e.check_invariants()
    assert e.pages.num_free == e.pages.num_pages and e.slots.num_free == e.slots.num_slots


def test_burst_with_a_new_shared_prefix_shares_it(ckpt, model, reference):
    """Requests arriving together: the first computes the prefix and saves its state where the
    others diverge; they wait for it and hit it (in-batch prefix sharing)."""
    e = make(ckpt, model)
    system = toks(1150, 50)
    prompts = [system + toks(1151 + i, 6) for i in range(5)]
    got = run(e, prompts)
    assert [r.cached_tokens for r in got] == [0] + [len(system)] * 4
    assert_same(got, [reference(p) for p in prompts])


def test_prefill_warmup_returns_everything_and_leaves_no_trace(ckpt, model, reference):
    """The start-up prefill warm-up (run on the GPU, where it compiles each kernel variant ahead
    of traffic) hands back every page and slot it took, and the requests served afterwards get
    the same tokens as without it (its slots' states are not read by a prefix-0 request)."""
    e = make(ckpt, model, disable_radix_cache=True)
    pages, slots = e.pages.num_free, e.slots.num_free
    ran = warm_prefill(e.runner, e.pages, e.slots, 40, max_batch_tokens=60)
    # the sizes up to 40 (4: a short prompt's own kernel variants); c's 40-token prefill; mixed 33 + 17 + 1; two prefills 32 + 31; many
    # prefills within 60 tokens (a decode row on top): 3 x 20, 8 x 7 + 1, 16 x 3 + 1, 17 x 3,
    # 32 x 1 is too short
    assert ran == [1, 4, 31, 32, 40, 51, 63, 60, 57, 49, 51]
    assert (e.pages.num_free, e.slots.num_free) == (pages, slots)
    e.check_invariants()
    prompts = [toks(50 + i, n) for i, n in enumerate([12, 33])]
    assert_same(run(e, prompts), [reference(p) for p in prompts])


def test_slow_steps_are_logged_with_their_batch(ckpt, model, monkeypatch):
    """A synchronous step slower than SLOW_STEP_S is logged with what the batch held (so a
    mid-traffic stall, e.g. a kernel compiled on first use, can be traced to its shape)."""
    import glmrt.engine.engine as eng

    lines = []
    e = Engine(EngineConfig(model=ckpt, page_size=PS, disable_radix_cache=True), model=model, log=lines.append)
    monkeypatch.setattr(eng, "SLOW_STEP_S", 0.0)
    run(e, [toks(70, 20), toks(71, 5)], greedy(2))
    slow = [x for x in lines if x.startswith("slow step")]
    assert slow and "25 tokens, 2 requests (0 decode rows; prefill chunks tokens@prefix: 20@0, 5@0)" in slow[0]
    assert any("2 tokens, 2 requests (2 decode rows" in x for x in slow)
    assert "no Triton kernel compiled in it" in slow[0]  # the CPU reference: nothing compiles


def test_a_step_that_compiled_is_logged_however_short(ckpt, model):
    """A kernel compiled mid-traffic is a gap in the start-up warm-up even when the step stays
    under SLOW_STEP_S (a quick compile, a cache load): the step is logged with its batch and the
    kernels (recorded as Triton's post-compile hook records them; the CPU reference compiles none)."""
    from glmrt.engine import compile_watch as cw

    lines = []
    e = Engine(EngineConfig(model=ckpt, page_size=PS, disable_radix_cache=True), model=model, log=lines.append)
    execute = e.runner.execute

    def compiling(plan):
        if any(w.num > 1 for w in plan.work):
            cw._compiled.append("_gate_up_kernel: [BLOCK_M=64]")
        return execute(plan)
    e.runner.execute = compiling
    run(e, [toks(72, 20)], greedy(2))
    logged = [x for x in lines if x.startswith("step compiled kernels")]
    assert len(logged) == 1 and "20 tokens, 1 requests" in logged[0]
    assert "1 Triton kernels compiled in it (_gate_up_kernel); the first: _gate_up_kernel: [BLOCK_M=64]" in logged[0]
    assert not any(x.startswith("slow step") for x in lines)


def test_compile_watch_names_the_kernels_a_step_compiled(monkeypatch):
    """The slow-step log names the Triton kernels compiled during the step, from Triton's
    post-compile hook (called by the JIT after each compile; here called as the JIT would)."""
    from types import SimpleNamespace

    knobs = pytest.importorskip("triton").knobs
    from glmrt.engine import compile_watch as cw
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(cw, "_installed", False)
    assert cw.install()
    cw.take()
    knobs.runtime.jit_post_compile_hook(key=None, repr="_down_kernel[num_warps=8](D: i32, I: i32)",
                                        fn=SimpleNamespace(name="backends.kernels.fused_moe._down_kernel"),
                                        compile={}, is_manual_warmup=False, already_compiled=False)
    got = cw.take()
    assert got == ["_down_kernel: _down_kernel[num_warps=8](D: i32, I: i32)"] and cw.take() == []
    assert cw.summary(got) == ("1 Triton kernels compiled in it (_down_kernel); the first: "
                               "_down_kernel: _down_kernel[num_warps=8](D: i32, I: i32)")
    assert cw.summary(got * 25 + ["_sum_kernel: _sum_kernel[]()"]).startswith(
        "26 Triton kernels compiled in it (_down_kernel x25, _sum_kernel); the first: _down_kernel")


def test_a_model_handed_in_runs_where_it_lives(ckpt, model, monkeypatch):
    """device "auto" with a model built beforehand: the engine takes the model's device, not the
    first GPU's (on a CUDA host a CPU model was given CUDA pools and graphs)."""
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: "cuda")  # as on a CUDA host
    monkeypatch.setattr(EngineConfig, "resolved_dtype", lambda self, device: "bfloat16")  # CUDA's auto
    e = make(ckpt, model)
    assert e.device_name == "cpu" and all(t.device.type == "cpu" for t in e.cache.state.tensors)
    assert e.dtype_name == "float32"  # the model's, not what "auto" would pick for the device
    out = run(e, [toks(7, 12)], greedy(3))
    assert len(out[0].output_ids) == 3


def test_a_model_without_weights_is_refused(ckpt):
    import types

    with pytest.raises(ValueError, match="meta device"):
        Engine(EngineConfig(model=ckpt), model=types.SimpleNamespace(device=torch.device("meta")), log=lambda *a: None)
