"""Speculative decoding (EAGLE chain from the MTP layer) in the engine, on the tiny model (CPU, fp32).

Greedy tokens equal a run without speculation; with the drafts replaced by the right tokens and
the accepted count capped per step (the Speculator's test hooks), every count from 0 to k runs,
and after each step the request's state — KDA recurrent state, conv window, indexer tails, KV
rows and pooled keys, of the model and of the draft layer — equals a prefill of the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from backends.meta import BatchMeta  # noqa: E402
from glmrt.cache.pools import ModelCache  # noqa: E402
from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402

PS = 8   # small pages (and the tiny model's k-pools of 4): drafts cross both often


@pytest.fixture(scope="module")
def mtp_model(ckpt):
    from backends.reference import ReferenceOps
    from glmrt.model.loader import load_checkpoint
    m, _ = load_checkpoint(ckpt, ReferenceOps(), dtype=torch.float32, with_mtp=True)
    return m


def make(ckpt, model, k=0, **kw) -> Engine:
    kw.setdefault("page_size", PS)
    if k:
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=k)
    return Engine(EngineConfig(model=ckpt, **kw), model=model, log=lambda *a: None)


def toks(seed, n):
    g = random.Random(seed)
    return [g.randrange(1, 900) for _ in range(n)]


def greedy(n=12, **kw):
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=n, logprobs=True, top_logprobs=2, **kw)


def outputs(engine, prompts, params):
    outs = engine.generate(prompts, params)
    engine.check_invariants()
    return [[(c.output_ids, c.finish_reason, c.logprobs) for c in group] for group in outs]


def assert_same(got, want):
    for g_group, w_group in zip(got, want):
        for (g_ids, g_fin, g_lp), (w_ids, w_fin, w_lp) in zip(g_group, w_group):
            assert g_ids == w_ids and g_fin == w_fin
            assert g_lp == pytest.approx(w_lp, abs=1e-4)


def oracle(reference: dict[tuple[int, ...], list[int]]):
    """A draft hook giving each request the tokens the model will choose (a run without speculation)."""
    def hook(req, drafts):
        want = reference[tuple(req.prompt_ids)]
        n = len(req.output_ids)
        return (want[n:n + len(drafts)] + drafts)[:len(drafts)]
    return hook


PROMPTS = [toks(1, 13), toks(2, 27), toks(3, 6), toks(1, 13)[:9] + toks(4, 11)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_without_speculation(ckpt, model, mtp_model, k):
    """Random drafts (mostly rejected) and right drafts with every accepted count: the same tokens,
    finish reasons and logprobs as a run without speculation, with chunked prefill, a prefix hit,
    stop tokens, min_tokens and max_tokens landing inside an accepted run."""
    base = make(ckpt, model, chunked_prefill_size=10)
    plain = outputs(base, PROMPTS, greedy(17))
    reference = {tuple(p): g[0][0] for p, g in zip(PROMPTS, plain)}
    stop = plain[1][0][0][6]
    params = [greedy(17), greedy(17, stop_token_ids=[stop], ignore_eos=False), greedy(11, min_tokens=4),
              greedy(9)]
    want = outputs(make(ckpt, model, chunked_prefill_size=10), PROMPTS, params)
    assert want[1][0][1] == "stop" and len(want[1][0][0]) <= 7
    spec = make(ckpt, mtp_model, k, chunked_prefill_size=10)
    assert_same(outputs(spec, PROMPTS, params), want)
    assert spec.spec.stats.cycles > 0
    spec = make(ckpt, mtp_model, k, chunked_prefill_size=10)
    spec.spec.draft_override = oracle(reference)
    counts = iter(range(10**6))
    spec.spec.accept_cap = lambda req, a: next(counts) % (k + 1)
    assert_same(outputs(spec, PROMPTS, params), want)
    st = spec.spec.stats
    assert st.accepted > 0 and st.emitted > st.cycles


# ---- state after each step against a prefill of the same tokens ---------------------------------
def prefill_state(model, ids: list[int], ps: int):
    """The model's and the draft layer's cache after a plain prefill of `ids` (one request, slot 0,
    pages 0..)."""
    text = model.config.text
    n_pages = -(-len(ids) // ps) + 1
    cache = ModelCache.allocate(text, n_pages, 1, "cpu", page_size=ps, kv_dtype="float32", model_dtype="float32",
                                with_mtp=True)
    pages = list(range(n_pages))
    meta = BatchMeta.build([0], [len(ids)], [0], [pages], ps, "cpu")
    t = torch.tensor(ids)
    _, hidden = model(t, meta, cache)
    if len(ids) > 1:
        dmeta = BatchMeta.build([0], [len(ids) - 1], [0], [pages], ps, "cpu")
        model.mtp(model.model.embed(t[1:]), hidden[:-1], dmeta, cache)
    return cache, pages, hidden[-1]


def assert_state_equal(engine, req, model):
    """`req`'s state at its computed position equals a prefill's: the model's KDA state, conv window,
    indexer tails, KV rows and complete pooled keys, and the draft layer's (one position behind)."""
    n = req.num_computed
    ids = (req.prompt_ids + req.output_ids)[:n]
    ref, ref_pages, last = prefill_state(model, ids, engine.config.page_size)
    text = model.config.text
    got, slot, kp = engine.cache, req.slot, text.index_kpool
    close = dict(atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(got.state.conv[:, slot], ref.state.conv[:, 0], **close)
    torch.testing.assert_close(got.state.recurrent[:, slot], ref.state.recurrent[:, 0], **close)
    torch.testing.assert_close(got.state.last_hidden[0, slot], last, **close)

    def rows(cache, pages, layer, upto):
        flat = cache.latent(layer)[pages].reshape(-1, cache.latent(layer).shape[-1])
        return flat[:upto]

    def pools(cache, pages, layer, upto):
        pooled = cache.pooled(layer)[pages].reshape(-1, cache.pooled(layer).shape[-1])
        return pooled[:upto // kp]

    for layer in list(text.dsa_layers) + [text.num_hidden_layers]:
        upto = n if layer < text.num_hidden_layers else n - 1   # the draft layer is one position behind
        torch.testing.assert_close(rows(got, req.pages, layer, upto), rows(ref, ref_pages, layer, upto), **close)
        if layer in text.indexer_layers or layer == text.num_hidden_layers:
            torch.testing.assert_close(pools(got, req.pages, layer, upto), pools(ref, ref_pages, layer, upto),
                                       **close)
            t = upto % kp
            for a, b in zip(got.tail(layer), ref.tail(layer)):
                torch.testing.assert_close(a[slot, :t], b[0, :t], **close)


@pytest.mark.parametrize("k", [2, 5])
def test_every_accepted_count_rolls_back_exactly(ckpt, model, mtp_model, k):
    """Right drafts, accepted counts forced through 0..k in turn: after every step the request's
    state equals a prefill of its tokens (a rollback that kept a rejected position's conv input,
    recurrent update or indexer key, or a draft layer that missed an accepted token, shows here)."""
    prompt = toks(7, 10)
    want = outputs(make(ckpt, model, disable_radix_cache=True), [prompt], greedy(24))[0][0]
    e = make(ckpt, mtp_model, k, disable_radix_cache=True)
    e.spec.draft_override = oracle({tuple(prompt): want[0]})
    cap = iter([a for _ in range(20) for a in range(k + 1)])
    seen = set()

    def capped(req, a):
        c = next(cap)
        seen.add(min(a, c))
        return c
    e.spec.accept_cap = capped
    rid = e.add_request(prompt, greedy(24))[0]
    req = e.requests[rid]
    while e.has_work():
        e.step()
        if not req.finished and req.num_computed >= len(prompt):
            assert_state_equal(e, req, mtp_model)
    assert req.output_ids == want[0]
    assert seen == set(range(k + 1))
    e.check_invariants()


def test_random_traffic_with_aborts_and_retractions_leaves_nothing(ckpt, mtp_model):
    """Random requests (greedy ones drafting, sampled ones not, stops, n > 1), random aborts, pools
    tight enough to retract: the invariants hold at every step, and after a cache flush every page
    and slot is free."""
    e0 = make(ckpt, mtp_model, 3)
    lay = e0.layout
    budget = 36 * lay.state_bytes_per_slot + 14 * lay.kv_bytes_per_page
    e = make(ckpt, mtp_model, 3, max_mamba_cache_size=36, cache_memory_gb=budget / 2**30,
             state_checkpoint_interval=8, chunked_prefill_size=16, max_prefill_tokens=48)
    rng = random.Random(0)
    shared = [toks(1000 + i, 24) for i in range(3)]
    live: list[str] = []
    submitted = 0
    while submitted < 500 or e.has_work():
        for _ in range(rng.randrange(0, 12)):
            if submitted >= 500:
                break
            prompt = ((rng.choice(shared)[: rng.randrange(0, 24)] if rng.random() < 0.6 else [])
                      + toks(submitted, rng.randrange(1, 10)))
            params = SamplingParams(temperature=rng.choice([0.0, 0.0, 1.0]), max_tokens=rng.randrange(1, 14),
                                    ignore_eos=rng.random() < 0.7, n=rng.choice([1, 1, 1, 2]),
                                    seed=rng.randrange(100), stop_token_ids=[rng.randrange(1, 1000)])
            live += e.add_request(prompt, params)
            submitted += 1
        if live and rng.random() < 0.3:
            e.abort(live.pop(rng.randrange(len(live))))
        e.step()
        e.check_invariants()
        for rid in [r for r in live if e.requests[r].finished]:
            live.remove(rid)
        for rid in [r for r, q in e.requests.items() if q.finished]:
            del e.requests[rid]
    assert e.counters["retractions"] > 0, "the pools were not tight enough to exercise retraction"
    assert e.spec.stats.cycles > 100
    e.flush_cache()
    e.check_invariants()
    assert e.pages.num_free == e.pages.num_pages and e.slots.num_free == e.slots.num_slots


# ---- temperature > 0: rejection sampling keeps the model's distribution --------------------------
def last_logits(model, ids: list[int]) -> torch.Tensor:
    text = model.config.text
    n_pages = -(-len(ids) // PS)
    cache = ModelCache.allocate(text, n_pages, 1, "cpu", page_size=PS, kv_dtype="float32", model_dtype="float32")
    meta = BatchMeta.build([0], [len(ids)], [0], [list(range(n_pages))], PS, "cpu")
    logits, _ = model(torch.tensor(ids), meta, cache, logits_indices=torch.tensor([len(ids) - 1]))
    return logits


def chi_square_p(counts: dict[int, int], probs: dict[int, float], total: int) -> float:
    """Pearson's test of observed counts against probabilities (bins expecting < 5 merged) -> p-value."""
    bins, rest_obs, rest_exp = [], 0, 0.0
    for tok, p in probs.items():
        if p * total >= 5:
            bins.append((counts.get(tok, 0), p * total))
        else:
            rest_obs, rest_exp = rest_obs + counts.get(tok, 0), rest_exp + p * total
    rest_obs += sum(c for t, c in counts.items() if t not in probs)
    if rest_exp > 0 or rest_obs:
        bins.append((rest_obs, rest_exp))
    assert all(e > 0 for _, e in bins), f"observed tokens the model cannot sample: {bins}"
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_model_distribution(ckpt, mtp_model):
    """Temperature 1, top-k 4 (a vocabulary slice of 4 tokens per position), 2,400 seeded requests,
    with a draft that proposes a token outside the model's top 4 half the time and spreads the rest
    unlike the model: the 2nd and 3rd tokens' frequencies match the model's exact distribution
    (chi-square), while drafts are both accepted and rejected."""
    from glmrt.engine.sampler import Sampler, SamplerRow

    k, n = 2, 2400
    prompt = toks(11, 9)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    sampler = Sampler(use_kernel=False)

    def dist(ctx):  # the model's filtered distribution after prompt + ctx, as {token: p}
        p = sampler.probabilities(last_logits(mtp_model, prompt + ctx), [SamplerRow(params, prompt, ctx)])[0]
        return {int(t): float(p[t]) for t in torch.nonzero(p).flatten()}

    d1 = dist([])
    d2 = {t1: dist([t1]) for t1 in d1}
    d3 = {(t1, t2): dist([t1, t2]) for t1 in d1 for t2 in d2[t1]}
    p2: dict[int, float] = {}
    p3: dict[int, float] = {}
    for t1, a in d1.items():
        for t2, b in d2[t1].items():
            p2[t2] = p2.get(t2, 0.0) + a * b
            for t3, c in d3[(t1, t2)].items():
                p3[t3] = p3.get(t3, 0.0) + a * b * c
    vocab = mtp_model.config.text.vocab_size

    def draft_logits(req, drafts, x):
        ctx = tuple(req.output_ids + drafts)
        top = sorted((d2.get(ctx[0]) if len(ctx) == 1 else d3.get(ctx, {})) or {}, key=lambda t: -t)
        off = [t for t in range(1, 40) if t not in top][:4]
        q = torch.full((1, vocab), float("-inf"))
        for j, t in enumerate(top):   # the model's tokens, in proportions unlike the model's
            q[0, t] = float(j)
        for t in off:                 # and tokens it never samples, half the mass
            q[0, t] = 1.0
        return q

    e = make(ckpt, mtp_model, k)
    e.spec.draft_logits = draft_logits
    outs = e.generate([prompt] * n, [params.replace(seed=i) for i in range(n)])
    e.check_invariants()
    seconds = [c[0].output_ids[1] for c in outs]
    thirds = [c[0].output_ids[2] for c in outs]
    st = e.spec.stats
    assert 0 < st.accepted < st.drafted, (st.accepted, st.drafted)
    for got, want in ((seconds, p2), (thirds, p3)):
        counts: dict[int, int] = {}
        for t in got:
            counts[t] = counts.get(t, 0) + 1
        assert chi_square_p(counts, want, n) > 1e-3, (counts, want)


def test_memory_plan_reserves_the_draft_kv_and_rollback_snapshots():
    """The rollback snapshots come out of the state budget (one per running request, clamping
    max_running_requests to a third of the slots), the draft layer's rows out of the KV budget,
    and the fit of an engine counts the MTP layer's weights."""
    from glmrt.cache.layout import CacheLayout
    from glmrt.checkpoint.presets import preset_config
    from glmrt.engine.fit import engine_fit
    from glmrt.engine.memory import draft_kv_bytes, plan_memory

    text = preset_config("tiny").text
    plain = CacheLayout.from_config(text, page_size=PS)
    mtp = CacheLayout.from_config(text, page_size=PS, with_mtp=True)
    assert mtp.kv_bytes_per_token - plain.kv_bytes_per_token == draft_kv_bytes(
        text, kv_dtype="bfloat16", model_dtype="bfloat16") > 0
    budget = 30 * mtp.state_bytes_per_slot + 100 * mtp.kv_bytes_per_page
    a = plan_memory(mtp, budget, max_mamba_cache_size=30)
    b = plan_memory(mtp, budget, max_mamba_cache_size=30, rollback=True)
    assert (a.max_running_requests, a.num_slots, a.rollback_slots) == (15, 30, 0)
    assert (b.max_running_requests, b.num_slots, b.rollback_slots) == (10, 20, 10)
    assert b.state_bytes + b.rollback_bytes == a.state_bytes and "rollback reserve" in b.describe()
    mc = preset_config("tiny")
    fits = [engine_fit(mc, EngineConfig(model=None, **kw), gpu_bytes=4 * 2**30, kv_dtype="bfloat16")
            for kw in ({}, {"speculative_algorithm": "MTP", "speculative_num_steps": 2})]
    assert fits[1].weight_bytes > fits[0].weight_bytes
    assert fits[1].memory.rollback_slots == fits[1].memory.max_running_requests > 0


# ---- an engine of two ranks speculates as one does -----------------------------------------------
def _spec_serve(engine) -> list:
    prompts = [toks(50 + i, 9 + 5 * i) for i in range(3)]
    out = []
    for group in engine.generate(prompts, greedy(10)):
        out += [(c.output_ids, c.logprobs) for c in group]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True, logprobs=True)
    for group in engine.generate(prompts[:2], seeded):
        out += [(c.output_ids, c.logprobs) for c in group]
    return out


def _spec_rank_main(rank: int, rendezvous: str, ckpt: str, result: str) -> None:
    import json

    torch.set_num_threads(1)
    from glmrt.engine.model_rank import ModelRank
    from glmrt.engine.ranks import join_group, leave_group
    parallel, link = join_group(rank, 2, 1, rendezvous, "cpu")
    cfg = EngineConfig(model=ckpt, page_size=PS, speculative_algorithm="EAGLE", speculative_num_steps=3)
    if rank:
        ModelRank(cfg, log=lambda *a: None, parallel=parallel, link=link).follow()
    else:
        engine = Engine(cfg, log=lambda *a: None, parallel=parallel, link=link)
        out = _spec_serve(engine)
        engine.runner.stop_followers()
        with open(result, "w") as f:
            json.dump({"out": out, "cycles": engine.spec.stats.cycles}, f)
    leave_group()


@pytest.mark.timeout(300)
def test_two_ranks_speculate_as_one_rank_does(ckpt, tmp_path):
    """The draft chain, the verify forward and the rollback replay are published steps like any
    other: an engine of two ranks (gloo) gives one rank's tokens and logprobs."""
    from tests.engine.test_engine_ranks import run_two_ranks
    two = run_two_ranks(_spec_rank_main, tmp_path, ckpt)
    one = _spec_serve(Engine(EngineConfig(model=ckpt, page_size=PS, speculative_algorithm="EAGLE",
                                          speculative_num_steps=3), log=lambda *a: None))
    assert two["cycles"] > 0
    assert [ids for ids, _ in two["out"]] == [ids for ids, _ in one]
    for (_, lp2), (_, lp1) in zip(two["out"], one):
        if lp1:
            assert max(abs(a - b) for a, b in zip(lp2, lp1)) <= 1e-5 * max(abs(x) for x in lp1)


# ---- prefill/decode disaggregation ----------------------------------------------------------------
def test_prefill_decode_speculation_equals_unified(ckpt, model, mtp_model):
    """The prefill runs the draft layer over the prompt; its rows (the pools' last ordinals) and the
    kept hidden state travel with the handoff; the decode drafts and verifies: the tokens of a
    unified engine without speculation, and the decode side's draft state equals a prefill's."""
    from glmrt.engine import handoff

    prompts = [toks(60 + i, n) for i, n in enumerate([5, 17, 26])]
    want = outputs(make(ckpt, model, disable_radix_cache=True), prompts, greedy(14))
    reference = {tuple(p): w[0][0] for p, w in zip(prompts, want)}
    prefill, decode = make(ckpt, mtp_model, 3, role="prefill"), make(ckpt, mtp_model, 3, role="decode")
    assert prefill.memory.rollback_slots == 0 < decode.memory.rollback_slots
    decode.spec.draft_override = oracle(reference)
    counts = iter(range(10**6))
    decode.spec.accept_cap = lambda req, a: next(counts) % 4
    got = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        source, sink = handoff.HandoffSource(prefill), handoff.HandoffSink(decode)
        prefill.add_request(p, greedy(14), rid=rid)
        while not source.holds(rid):
            prefill.step()
        sink.reserve(rid, p, source.parked(rid).first_token, greedy(14))
        assert "kept_hidden" in [c.kind for c in sink.reservation(rid).components]
        handoff.copy_in_process(source, sink, rid)
        source.release(rid)
        sink.activate(rid)
        req = decode.requests[rid]
        while not req.finished:
            decode.step()
            if not req.finished:
                assert_state_equal(decode, req, mtp_model)
        # the first token's logprob is the prefill's (it reached the client from there)
        assert len(req.logprobs) == len(req.output_ids) - 1
        got.append([(req.output_ids, req.finish_reason, want[i][0][2][:1] + req.logprobs)])
        prefill.check_invariants()
        decode.check_invariants()
    assert_same(got, want)
    assert decode.spec.stats.accepted > 0


def test_usage_counts_the_decode_steps(ckpt, mtp_model):
    """Each output reports the request's decode steps so far (SGLang's spec_verify_ct): with drafts
    accepted, fewer steps than tokens after the first."""
    e = make(ckpt, mtp_model, 3)
    with pytest.raises(ValueError, match="off while speculating"):
        e.overlap = True
    prompt = toks(70, 12)
    want = outputs(make(ckpt, mtp_model, disable_radix_cache=True), [prompt], greedy(13))[0][0][0]
    e.spec.draft_override = oracle({tuple(prompt): want})
    rid = e.add_request(prompt, greedy(13))[0]
    last = None
    while e.has_work():
        for o in e.step():
            last = o
    assert last.finished and last.completion_tokens == 13
    assert last.spec_verify_ct == e.requests[rid].spec_verify_ct == 3   # 12 tokens after the first, 4 a step


def test_retraction_and_n_choices_keep_the_tokens(ckpt, model, mtp_model):
    """Pools so tight that drafting requests are retracted (and re-prefill, then draft again), and
    n = 2 greedy choices sharing a prefill: the tokens of a run without speculation."""
    prompts = [toks(80 + i, 12) for i in range(4)]
    want = outputs(make(ckpt, model, disable_radix_cache=True), prompts, greedy(16))
    reference = {tuple(p): w[0][0] for p, w in zip(prompts, want)}
    e0 = make(ckpt, mtp_model, 3)
    lay = e0.layout
    budget = 64 * lay.state_bytes_per_slot + 6 * lay.kv_bytes_per_page
    e = make(ckpt, mtp_model, 3, max_mamba_cache_size=64, cache_memory_gb=budget / 2**30, disable_radix_cache=True)
    e.spec.draft_override = oracle(reference)
    assert_same(outputs(e, prompts, greedy(16)), want)
    assert e.counters["retractions"] > 0 and e.spec.stats.accepted > 0
    e = make(ckpt, mtp_model, 3)
    got = outputs(e, prompts[:2], greedy(16).replace(n=2))
    assert_same([[g[0]] for g in got] + [[g[1]] for g in got], want[:2] + want[:2])


def test_a_grammar_request_decodes_beside_drafting_ones(ckpt, model, mtp_model):
    """A constrained request decodes one token per step in the batches that verify drafts: the
    same answer as without speculation."""
    from glmrt.sampling_params import Grammar

    g = Grammar("regex", "[a-c]{3,6}")
    got = []
    for m, k in ((model, 0), (mtp_model, 3)):
        e = make(ckpt, m, k)
        a = e.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=12), grammar=g)[0]
        b = e.add_request(toks(90, 8), greedy(12))[0]
        while e.has_work():
            e.step()
        e.check_invariants()
        got.append((e.requests[a].output_ids, e.requests[a].finish_reason, e.requests[b].output_ids))
        if k:
            assert e.spec.stats.cycles > 0 and e.requests[a].spec_verify_ct > 0
    assert got[0] == got[1]


def test_more_decodes_than_rollback_snapshots_draft_in_turn(ckpt, model, mtp_model):
    """n = 4 forks on an engine of max_running_requests 2 run four decodes against a reserve of
    two snapshot slots: at most two draft in a step, the rest decode one token; the tokens are
    those of a run without speculation."""
    prompt = toks(91, 10)
    want = outputs(make(ckpt, model, disable_radix_cache=True), [prompt], greedy(12).replace(n=4))
    e = make(ckpt, mtp_model, 3, max_running_requests=2)
    assert e.memory.rollback_slots == 2
    e.spec.draft_override = oracle({tuple(prompt): want[0][0][0]})
    assert_same(outputs(e, [prompt], greedy(12).replace(n=4)), want)
    assert e.spec.stats.accepted > 0
