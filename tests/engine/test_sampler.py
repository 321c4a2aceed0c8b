"""Sampler and SamplingParams: greedy, filters, penalties, min_tokens, seeded reproducibility, logprobs."""

import math
from collections import Counter

import pytest
import torch

from glmrt.engine.sampler import Sampler, SamplerRow
from glmrt.sampling_params import SamplingParams

torch.set_num_threads(1)

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOG_PROBS = torch.tensor(PROBS).log()


def row(prompt=(), output=(), generator=None, eos=(), **params):
    return SamplerRow(SamplingParams(**params), list(prompt), list(output), generator, list(eos))


def greedy_token(logits, **kw):
    return Sampler().sample(torch.tensor([logits]), [row(temperature=0.0, **kw)]).tokens[0]


def frequencies(num=4000, seed=0, **params):
    """Draw `num` tokens from PROBS as seeded rows sharing one generator; token -> frequency."""
    g = torch.Generator().manual_seed(seed)
    rows = [row(generator=g, **params) for _ in range(num)]
    tokens = Sampler().sample(LOG_PROBS.expand(num, -1), rows).tokens
    return {t: c / num for t, c in Counter(tokens).items()}


def expect(freq, probs):
    """`freq` has exactly the support of `probs` (renormalised) and roughly its frequencies."""
    total = sum(probs.values())
    assert set(freq) == set(probs)
    for t, p in probs.items():
        assert abs(freq[t] - p / total) < 0.04, (t, freq[t], p / total)


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    assert greedy_token([1.0, 3.0, 3.0, 0.0]) == 1
    assert greedy_token([5.0, 5.0, 5.0]) == 0
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.tokens == logits.argmax(-1).tolist()


def test_all_greedy_batches_skip_the_kernels(monkeypatch):
    """A batch of greedy rows is one argmax, also where the kernel path is forced: the kernels
    are never loaded (on the H200 their three passes cost more than the argmax)."""
    import glmrt.engine.sampler as sampler_mod

    def no_kernels():
        raise AssertionError("the kernel path was taken for an all-greedy batch")
    monkeypatch.setattr(sampler_mod, "_load_kernels", no_kernels)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    logits[2, [7, 9]] = 100.0  # a tie: the lowest id
    rows = [row(temperature=0.0, repetition_penalty=1.3 if i % 2 else 1.0, output=[9]) for i in range(8)]
    out = Sampler(use_kernel=True).sample(logits, rows)
    assert out.tokens[2] == 7
    assert out.tokens == Sampler(use_kernel=False).sample(logits, rows).tokens


def test_temperature_zero_and_top_k_one_agree_and_draw_nothing():
    logits = torch.tensor([[0.5, 3.0, 2.0, 1.0]]).expand(4, -1)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    rows = [row(temperature=0.0), row(top_k=1, temperature=1.5, generator=g),
            row(temperature=0.0, output=[1], presence_penalty=1.5),  # 3 - 1.5 < 2: penalties apply
            row(top_k=1, output=[1], presence_penalty=1.5)]
    assert Sampler().sample(logits, rows).tokens == [1, 1, 2, 2]
    assert torch.equal(g.get_state(), state)  # a greedy row consumes no generator state


@pytest.mark.parametrize(
    "params, support",
    [
        ({}, dict(enumerate(PROBS))),
        ({"top_k": 3}, {0: 0.4, 1: 0.25, 2: 0.15}),
        ({"top_p": 0.6}, {0: 0.4, 1: 0.25}),
        ({"min_p": 0.3}, {0: 0.4, 1: 0.25, 2: 0.15}),  # threshold 0.12
        ({"min_p": 0.5}, {0: 0.4, 1: 0.25}),  # threshold 0.2
        ({"top_k": 3, "top_p": 0.6}, {0: 0.4, 1: 0.25}),
        ({"top_k": 4, "top_p": 0.95, "min_p": 0.2}, {0: 0.4, 1: 0.25, 2: 0.15, 3: 0.1}),
        ({"temperature": 0.5}, {i: p**2 for i, p in enumerate(PROBS)}),
    ],
)
def test_filters_restrict_the_support(params, support):
    expect(frequencies(**params), support)


def test_top_p_runs_on_the_top_k_renormalised_distribution():
    # after top_k=2 the probs are [0.615, 0.385]: 0.615 >= 0.6 alone (unrenormalised 0.4 would not be)
    assert set(frequencies(num=500, top_k=2, top_p=0.6)) == {0}


def test_unseeded_rows_share_one_global_draw():
    torch.manual_seed(0)
    num = 4000
    rows = [row(top_k=3) if i % 2 else row(top_k=4, top_p=0.8) for i in range(num)]  # both keep {0, 1, 2}
    tokens = Sampler().sample(LOG_PROBS.expand(num, -1), rows).tokens
    expect({t: c / num for t, c in Counter(tokens).items()}, {0: 0.4, 1: 0.25, 2: 0.15})


def test_repetition_penalty_divides_positive_and_multiplies_negative_once():
    assert greedy_token([2.0, 1.5]) == 0
    assert greedy_token([2.0, 1.5], prompt=[0], repetition_penalty=1.5) == 1  # 2 / 1.5 < 1.5
    assert greedy_token([2.0, 1.5], prompt=[0, 0, 0], repetition_penalty=1.2) == 0  # once: 1.67 > 1.5
    assert greedy_token([2.0, 1.5], output=[0], repetition_penalty=1.5) == 1  # output counts too
    assert greedy_token([-1.0, -1.2], output=[0], repetition_penalty=1.5) == 1  # -1 * 1.5 < -1.2
    assert greedy_token([-1.0, -1.2], output=[0], repetition_penalty=1.1) == 0  # -1.1 > -1.2


def test_frequency_penalty_scales_with_count_and_ignores_prompt():
    assert greedy_token([3.0, 1.0], output=[0, 0], frequency_penalty=0.9) == 0  # 3 - 1.8 = 1.2
    assert greedy_token([3.0, 1.0], output=[0, 0], frequency_penalty=1.1) == 1  # 3 - 2.2 = 0.8
    assert greedy_token([3.0, 1.0], prompt=[0, 0, 0], frequency_penalty=2.0) == 0
    assert greedy_token([0.0, 1.0], output=[1], frequency_penalty=-0.5) == 1  # negative rewards
    assert greedy_token([1.0, 0.6], output=[1], frequency_penalty=-0.5) == 1  # 0.6 + 0.5 > 1


def test_presence_penalty_is_flat_and_ignores_prompt():
    assert greedy_token([3.0, 1.2], output=[0, 0, 0], presence_penalty=1.5) == 0  # 1.5 > 1.2
    assert greedy_token([3.0, 1.2], output=[0], presence_penalty=2.0) == 1  # 1.0 < 1.2
    assert greedy_token([3.0, 1.2], prompt=[0], presence_penalty=2.0) == 0


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = [0.0, 1.0, 4.0, 5.0]  # 3 = EOS, 2 = stop id
    kw = dict(eos=[3], stop_token_ids=[2], min_tokens=2)
    assert greedy_token(logits, output=[], **kw) == 1
    assert greedy_token(logits, output=[1], **kw) == 1
    assert greedy_token(logits, output=[1, 1], **kw) == 3
    g = torch.Generator().manual_seed(0)
    rows = [row(output=[1], generator=g, **kw) for _ in range(300)]
    tokens = Sampler().sample(torch.tensor([logits]).expand(300, -1), rows).tokens
    assert set(tokens) == {0, 1}


def seeded_sequence(position, others, seed=7, steps=20, vocab=64):
    """Run `steps` steps with the seeded row at `position` among `others` (factories of rows)."""
    sampler = Sampler()
    g = torch.Generator().manual_seed(seed)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                  frequency_penalty=0.3, presence_penalty=0.2, logprobs=True, top_logprobs=3)
    out: list[int] = []
    noise = torch.Generator().manual_seed(1000 + position + len(others))
    for step in range(steps):
        own = torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 3
        rows = [make(step) for make in others]
        rows.insert(position, row(prompt=[1, 2, 3], output=out, generator=g, **params))
        logits = torch.randn(len(rows), vocab, generator=noise) * 3
        logits[position] = own
        result = sampler.sample(logits.to(torch.bfloat16).float(), rows)
        out = out + [result.tokens[position]]
    return out


def test_seeded_rows_ignore_batch_composition_and_order():
    other_g = torch.Generator().manual_seed(99)
    others_a = [lambda s: row(temperature=1.0),
                lambda s: row(temperature=0.0, output=[s]),
                lambda s: row(generator=other_g, temperature=0.7, top_p=0.8, output=[s, s])]
    others_b = [lambda s: row(top_k=5, repetition_penalty=1.3, output=list(range(s))),
                lambda s: row(temperature=1.2, min_p=0.1, logprobs=True, top_logprobs=5),
                lambda s: row(generator=torch.Generator().manual_seed(s), min_tokens=3, eos=[0]),
                lambda s: row(top_k=1)]
    alone = seeded_sequence(0, [])
    assert seeded_sequence(0, others_a) == alone
    assert seeded_sequence(2, others_b) == alone
    assert seeded_sequence(3, others_a) == alone
    assert seeded_sequence(0, [], seed=8) != alone  # the seed matters: not greedy in disguise
    assert len(set(alone)) > 5


def test_seeded_row_consumes_exactly_vocab_exponentials():
    vocab = 32
    g, ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    Sampler().sample(torch.randn(2, vocab), [row(top_k=3, generator=g), row()])
    torch.empty(vocab).exponential_(generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())


def test_logprobs_are_raw_log_softmax():
    logits = (torch.randn(4, 30, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    raw = torch.log_softmax(logits.float(), dim=-1)
    rows = [row(logprobs=True, top_logprobs=5, temperature=0.3, top_k=3, output=[0, 1], frequency_penalty=2.0),
            row(logprobs=True, temperature=0.0, repetition_penalty=2.0, prompt=[int(raw[1].argmax())]),
            row(),
            row(logprobs=True, top_logprobs=20, generator=torch.Generator().manual_seed(0))]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None and out.top_logprobs[1] is None
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.tokens[i]].item(), abs=1e-6)
    for i, n in ((0, 5), (3, 20)):
        pairs = out.top_logprobs[i]
        assert len(pairs) == n
        assert [lp for _, lp in pairs] == sorted((lp for _, lp in pairs), reverse=True)
        assert [lp for _, lp in pairs] == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-6)
        assert all(raw[i, t].item() == pytest.approx(lp, abs=1e-6) for t, lp in pairs)
        assert math.isclose(sum(math.exp(lp) for lp in raw[i].tolist()), 1.0, rel_tol=1e-4)


def test_sampler_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 5), [row()])


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
     ("top_k", -2), ("min_p", 1.1), ("frequency_penalty", 2.5), ("presence_penalty", -3.0),
     ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17),
     ("top_logprobs", 21), ("n", 0), ("n", 129), ("seed", 1.5), ("stop_token_ids", [-1])],
)
def test_validation_names_the_field(field, value):
    kw = {field: value, "logprobs": True} if field == "top_logprobs" else {field: value}
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw).validate()


def test_validation_accepts_defaults_and_edges_and_checks_vocab():
    SamplingParams().validate(vocab_size=10)
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0,
                   min_tokens=16, logprobs=True, top_logprobs=20, n=128, seed=0, stop_token_ids=[9]).validate(10)
    with pytest.raises(ValueError, match="^top_logprobs .*logprobs"):
        SamplingParams(top_logprobs=2).validate()
    with pytest.raises(ValueError, match=r"^stop_token_ids .*\[0, 10\)"):
        SamplingParams(stop_token_ids=[3, 10]).validate(vocab_size=10)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy and not SamplingParams(temperature=0.01, top_k=2).is_greedy


def test_from_generation_config():
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2],
           "max_new_tokens": None}
    p = SamplingParams.from_generation_config(gen)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.95, 20, 16)
    p = SamplingParams.from_generation_config(gen, temperature=0.2, top_p=None, max_tokens=100, seed=3)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.2, 0.95, 20, 100, 3)
    greedy = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6})
    assert greedy.temperature == 0.0 and greedy.is_greedy
    assert SamplingParams.from_generation_config({"do_sample": False}, temperature=0.5).temperature == 0.5
    assert SamplingParams.from_generation_config({}) == SamplingParams()
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_generation_config({}, bogus=1)
