"""Exact repeats of a prompt are full hits: the whole prefill is skipped, the first token is
sampled from the last position's hidden state kept with the prompt-end checkpoint, and the
tokens are those of a cold run (greedy, or seeded sampling with the same seed)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)

from glmrt.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_engine import assert_same, greedy, make, run, toks  # noqa: E402


def test_repeat_is_a_full_hit_with_the_cold_tokens(ckpt, model):
    cold = make(ckpt, model, disable_radix_cache=True)
    e = make(ckpt, model)
    for n in (16, 37):  # page-aligned (8-token pages) and not
        prompt = toks(40 + n, n)
        want = run(cold, [prompt])[0]
        first = run(e, [prompt])[0]
        assert first.cached_tokens == 0
        again = run(e, [prompt])[0]
        assert again.cached_tokens == n
        assert_same([first, again], [want, want])
        assert run(e, [prompt])[0].cached_tokens == n
    assert e.counters["cached_prompt_tokens"] == 2 * (16 + 37)


def test_repeat_with_other_sampling_samples_fresh(ckpt, model):
    prompt = toks(60, 29)
    e = make(ckpt, model)
    cold = make(ckpt, model, disable_radix_cache=True)
    run(e, [prompt], greedy(4))
    for seed in (1, 2, 3):
        p = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        got = run(e, [prompt], p)[0]
        assert got.cached_tokens == len(prompt)
        assert got.output_ids == run(cold, [prompt], p)[0].output_ids
    outs = [run(e, [prompt], SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True))[0].output_ids
            for s in (11, 12, 13)]
    assert len({tuple(o) for o in outs}) > 1  # different seeds: fresh draws from the kept state


def test_n_choices_and_batched_repeats_full_hit(ckpt, model):
    prompt = toks(70, 21)
    e = make(ckpt, model)
    cold = make(ckpt, model, disable_radix_cache=True)
    run(e, [prompt], greedy(3))
    p = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True)
    out = e.generate([prompt], p)[0]
    e.check_invariants()
    assert [c.cached_tokens for c in out] == [len(prompt)] * 3
    want = cold.generate([prompt], p)[0]
    assert [c.output_ids for c in out] == [c.output_ids for c in want]
    # repeats batched with a fresh prompt in one step: the full hits and the prefill side by side
    other = toks(71, 13)
    got = run(e, [prompt, other, prompt], greedy(5))
    assert [r.cached_tokens for r in got] == [len(prompt), 0, len(prompt)]
    assert_same(got, run(cold, [prompt, other, prompt], greedy(5)))


def test_request_end_checkpoint_is_upgraded_for_a_full_hit(ckpt, model):
    """A prompt equal to a finished request's tokens: the checkpoint at its end kept no output,
    so the first repeat recomputes its last token and saves one that does; the next is full."""
    e = make(ckpt, model)
    cold = make(ckpt, model, disable_radix_cache=True)
    first = run(e, [toks(80, 19)], greedy(4))[0]
    turn = first.prompt_ids + first.output_ids[:-1]   # the request-end checkpoint's tokens
    a = run(e, [turn], greedy(4))[0]
    assert 0 < a.cached_tokens < len(turn)
    b = run(e, [turn], greedy(4))[0]
    assert b.cached_tokens == len(turn)
    want = run(cold, [turn], greedy(4))[0]
    assert_same([a, b], [want, want])
