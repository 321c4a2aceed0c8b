"""Prefill/decode handoff at the engine level: a prefill engine computes the prompt and the
first token, the typed state moves to a decode engine, which continues — the same greedy
tokens as one unified engine; the decode side reuses the KV pages it already caches."""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from glmrt.engine import handoff  # noqa: E402
from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_engine import assert_same  # noqa: E402


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2)


def toks(seed, n):
    g = random.Random(seed)
    return [g.randrange(1, 900) for _ in range(n)]


def make(ckpt, model, **kw):
    return Engine(EngineConfig(model=ckpt, page_size=8, **kw), model=model, log=lambda *a: None)


def pd_generate(prefill, decode, prompt, params, rid):
    source, sink = handoff.HandoffSource(prefill), handoff.HandoffSink(decode)
    prefill.add_request(prompt, params, rid=rid)
    while not source.holds(rid):
        prefill.step()
    res = sink.reserve(rid, prompt, source.parked(rid).first_token, params)
    moved = handoff.copy_in_process(source, sink, rid)
    source.release(rid)
    sink.activate(rid)
    while not decode.requests[rid].finished:
        decode.step()
    prefill.check_invariants()
    decode.check_invariants()
    return decode.requests.pop(rid), res, moved


def test_prefill_decode_equals_unified(ckpt, model):
    unified = make(ckpt, model, disable_radix_cache=True)
    prefill, decode = make(ckpt, model, role="prefill"), make(ckpt, model, role="decode")
    prompts = [toks(i, n) for i, n in enumerate([5, 23, 40])]
    want = [c[0] for c in unified.generate(prompts, greedy())]
    got = [pd_generate(prefill, decode, p, greedy(), f"r{i}")[0] for i, p in enumerate(prompts)]
    assert_same(got, want)


def test_seeded_sampling_continues_across_the_handoff(ckpt, model):
    # the decode draws on from where the prefill's first sampled token left the seed's generator
    unified = make(ckpt, model, disable_radix_cache=True)
    prefill, decode = make(ckpt, model, role="prefill"), make(ckpt, model, role="decode")
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    prompt = toks(40, 19)
    want = unified.generate([prompt], params)[0][0].output_ids
    got = pd_generate(prefill, decode, prompt, params, "s")[0].output_ids
    assert got == want
    assert want != unified.generate([prompt], params.replace(seed=8))[0][0].output_ids  # the seed matters


def test_decode_side_prefix_cache_receives_only_missing_pages(ckpt, model):
    prefill, decode = make(ckpt, model, role="prefill"), make(ckpt, model, role="decode")
    system = toks(50, 48)
    a, b = system + toks(51, 9), system + toks(52, 9)
    _, res_a, moved_a = pd_generate(prefill, decode, a, greedy(4), "a")
    got_b, res_b, moved_b = pd_generate(prefill, decode, b, greedy(4), "b")
    assert res_a.reused_tokens == 0 and res_b.reused_tokens == 48
    assert moved_b < moved_a
    unified = make(ckpt, model, disable_radix_cache=True)
    assert_same([got_b], [unified.generate([b], greedy(4))[0][0]])
    for e in (prefill, decode):
        e.flush_cache()
        e.check_invariants()
        assert e.pages.num_free == e.pages.num_pages and e.slots.num_free == e.slots.num_slots


def test_no_room_is_refused_cleanly(ckpt, model):
    e0 = make(ckpt, model)
    lay = e0.layout
    budget = 4 * lay.state_bytes_per_slot + 3 * lay.kv_bytes_per_page
    decode = make(ckpt, model, role="decode", max_mamba_cache_size=4, cache_memory_gb=budget / 2**30)
    with pytest.raises(handoff.HandoffError):
        handoff.HandoffSink(decode).reserve("big", toks(60, 200), 5, greedy())
    decode.check_invariants()
    assert decode.pages.num_free == decode.pages.num_pages


def test_sink_refuses_state_that_is_not_the_reservation_and_cancel_frees_it(ckpt, model):
    prefill, decode = make(ckpt, model, role="prefill"), make(ckpt, model, role="decode")
    source, sink = handoff.HandoffSource(prefill), handoff.HandoffSink(decode)
    prompt = toks(70, 21)
    prefill.add_request(prompt, greedy(), rid="x")
    while not source.holds("x"):
        prefill.step()
    res = sink.reserve("x", prompt, source.parked("x").first_token, greedy())
    assert [c.kind for c in res.components] == ["mla_latent_pages", "indexer_pages", "indexer_tail", "kda_conv",
                                                "kda_recurrent"]
    assert res.components[0].rows == res.pages == res.components[1].rows  # nothing reused: every page moves
    shifted = [type(c)(rows=[r + 1 for r in c.rows], num_bytes=c.num_bytes) for c in res.components]
    with pytest.raises(handoff.HandoffError, match="not the reservation"):
        sink.receive("x", shifted)
    with pytest.raises(handoff.HandoffError, match="kinds differ"):
        handoff.copy_rows(handoff.pool_tensors(prefill), source.export("x", 0)[::-1],
                          handoff.pool_tensors(decode), res.components)
    sink.cancel("x")
    source.release("x")
    assert not sink.holds("x") and not source.holds("x")
    decode.check_invariants()
    assert decode.pages.num_free == decode.pages.num_pages and decode.slots.num_free == decode.slots.num_slots


def test_layout_mismatch_names_every_differing_field(ckpt, model):
    a, b = make(ckpt, model, role="prefill"), Engine(EngineConfig(model=ckpt, page_size=16, mamba_ssm_dtype="bfloat16"),
                                                     model=model, log=lambda *a: None)
    assert handoff.layout_mismatch(handoff.handoff_layout(a), handoff.handoff_layout(a)) is None
    why = handoff.layout_mismatch(handoff.handoff_layout(b), handoff.handoff_layout(a))
    assert why.startswith("incompatible prefill/decode pair")
    assert "page_size: prefill 8 vs decode 16" in why and "state_dtype" in why and "kv_dtype" not in why


def test_transfer_environment_is_typed_and_refuses_unknown_values(monkeypatch):
    from glmrt import env
    monkeypatch.delenv("GLMRT_KV_TRANSFER", raising=False)
    monkeypatch.delenv("GLMRT_KV_CHECKSUM", raising=False)
    assert env.kv_transfer() == "auto" and env.kv_checksum() is False
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "zmq")
    monkeypatch.setenv("GLMRT_KV_CHECKSUM", "1")
    assert env.kv_transfer() == "zmq" and env.kv_checksum() is True
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "frames")
    with pytest.raises(ValueError, match="GLMRT_KV_TRANSFER"):
        env.kv_transfer()


def test_prefill_side_full_hit_on_a_repeat(ckpt, model):
    """A prompt the prefill engine has seen is a full hit there: no prefill, the same tokens."""
    unified = make(ckpt, model, disable_radix_cache=True)
    prefill, decode = make(ckpt, model, role="prefill"), make(ckpt, model, role="decode")
    prompt = toks(60, 27)
    want = unified.generate([prompt], greedy())[0][0]
    first = pd_generate(prefill, decode, prompt, greedy(), "x1")[0]
    again = pd_generate(prefill, decode, prompt, greedy(), "x2")[0]
    assert prefill.counters["cached_prompt_tokens"] == len(prompt)
    assert_same([first, again], [want, want])
