"""The cuda-h200 sampling kernels (backends.kernels.sampling) against the torch sampler.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is
set before Triton is imported); with CUDA the same tests run compiled (the "cuda" parameter).
The reference is the sampler's own torch path (`glmrt.engine.sampler._filter`, the sort-based
cuts, then argmax(z - log E)); fresh random inputs for every check, with ties (bf16 and coarser
rounding, one flat row with a huge tie group) and -inf entries. A small buffer capacity
(`CAP`) and split size make the small vocabularies take every path of the select kernel:
refinement passes, the final race pass, ties larger than the buffer (checked by `PATHS`).
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.kernels import sampling as ks  # noqa: E402
from glmrt.engine import sampler as sm  # noqa: E402
from glmrt.engine.sampler import Sampler, SamplerRow  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402
from tests.backends.conftest import gen as _gen  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

TINY = torch.finfo(torch.float32).tiny
CAP, CHUNK = 32, 256  # small: the vocabularies here then take every path

# info[:, 1] bits set by the select kernel (see _select_kernel)
UNFILTERED, NO_CUT, TOPK_MASS, TOPK_TIES, RACE_BUFFER, RACE_PASS, CUT_TIES, SPLIT_GATHERED = (
    1, 2, 4, 8, 16, 32, 64, 128)



def row(generator=None, output=(), prompt=(), eos=(), **params):
    return SamplerRow(SamplingParams(**params), list(prompt), list(output), generator, list(eos))


def _logits(g, batch, vocab, kind):
    """Fresh random logits of one family: 0 gaussian, 1 bf16 ties, 2 coarse ties, 3 one flat row."""
    x = torch.randn(batch, vocab, generator=g) * (torch.rand(batch, 1, generator=g) * 4 + 0.05)
    if kind == 1:
        x = x.to(torch.bfloat16).float()
    elif kind == 2:
        x = (x * 2).round() / 2
    elif kind == 3:
        x = (torch.randint(0, 3, (batch, vocab), generator=g) * 0.01).float()
        x[:, :3] = torch.tensor([2.0, 1.0, 0.5])
    for i in range(batch):
        if torch.rand(1, generator=g) < 0.3:  # some -inf entries (as min_tokens blocking leaves them)
            x[i, torch.randperm(vocab, generator=g)[: int(torch.randint(0, vocab, (1,), generator=g))]] = -math.inf
    return x


def _random_params(g, batch, vocab):
    """temperature, top_k, top_p, min_p per row: each filter on or off at random."""
    out = []
    for _ in range(batch):
        r = torch.rand(5, generator=g).tolist()
        out.append(dict(temperature=0.3 + 1.5 * r[0],
                        top_k=int(2 + r[1] * (vocab + 40)) if r[2] < 0.6 else -1,
                        top_p=0.3 + 0.7 * r[3] if r[3] < 0.85 else 1.0,
                        min_p=r[4] ** 3 if r[4] < 0.45 else 0.0))
    return out


def _kernel(x, params, noise, device, capacity=CAP, chunk=CHUNK, config=None):
    """Tokens and info [B, 2] (kept count, path bits) of random rows whose noise is noise[i]."""
    b, v = x.shape
    packed = ks.pack_params([max(p["temperature"], 1e-5) for p in params], [p["top_k"] for p in params],
                            [p["top_p"] for p in params], [p["min_p"] for p in params], list(range(b)), v)
    info = torch.full((b, 2), -1, dtype=torch.int32, device=device)
    out = torch.full((b,), -1, dtype=torch.long, device=device)
    config = {"small_sort": capacity // 2, **(config or {})}  # brackets on both sides of the small sort
    out.copy_(ks.sample(x.to(device), packed.to(device), noise.to(device), capacity=capacity, chunk=chunk, info=info,
                        config=config))
    return out.cpu(), info.cpu()


def _reference(x, params, noise):
    """The torch sampler's own cuts (`_filter`) and race on the same exponentials."""
    z = sm._filter(x.clone(), [row(**p) for p in params])
    return (z - noise.clamp_min(TINY).log()).argmax(dim=-1), z > -math.inf


def _check_prefix(x, params, kept_ref, nkept):
    """The reference keeps a prefix of the stable descending order, of the kernel's length."""
    for i, p in enumerate(params):
        z = x[i] / max(p["temperature"], 1e-5)
        order = z.sort(descending=True, stable=True).indices
        mask = kept_ref[i][order]
        n = int(mask.sum())
        assert mask[:n].all(), f"row {i}: reference cut is not a prefix"
        assert n == nkept[i], f"row {i} {p}: kept {int(nkept[i])} ids, the sort-based cut keeps {n}"


def test_greedy_rows_take_the_first_argmax(device):
    g = _gen("greedy")
    x = _logits(g, 6, 1500, 1)
    x[1, 700] = x[1, 900] = x[1].max() + 1  # a tie for the maximum: the lower id wins
    x[2] = -math.inf  # no finite logit: id 0, as argmax gives
    x[3, :] = 0.5
    packed = ks.pack_params([1.0] * 6, [1500] * 6, [1.0] * 6, [0.0] * 6, [-1] * 6, 1500)
    out = ks.sample(x.to(device), packed.to(device), None, capacity=CAP, chunk=CHUNK).cpu()
    assert out.tolist() == x.argmax(dim=-1).tolist()
    assert out[1] == 700 and out[2] == 0 and out[3] == 0


def test_top_k_one_takes_the_first_argmax_whatever_the_noise(device):
    g = _gen("top1")
    x = _logits(g, 6, 1200, 2)  # coarse ties
    params = [dict(temperature=0.2 + i * 0.3, top_k=1, top_p=1.0 if i % 2 else 0.5, min_p=0.0) for i in range(6)]
    noise = torch.empty(6, 1200).exponential_(generator=g)
    tokens, info = _kernel(x, params, noise, device)
    ref, kept = _reference(x, params, noise)
    z_argmax = [int((x[i] / params[i]["temperature"]).argmax()) for i in range(6)]
    assert tokens.tolist() == ref.tolist() == z_argmax
    assert info[:, 0].tolist() == [1] * 6


def test_fixed_exponentials_give_the_torch_samplers_token(device):
    paths = 0
    for kind in range(4):
        g = _gen("race", kind)
        b, v = 10, int(torch.randint(300, 1200, (1,), generator=g))
        x, params = _logits(g, b, v, kind), _random_params(g, b, v)
        noise = torch.empty(b, v).exponential_(generator=g)
        tokens, info = _kernel(x, params, noise, device)
        ref, kept = _reference(x, params, noise)
        assert tokens.tolist() == ref.tolist(), (kind, params)
        assert info[:, 0].tolist() == kept.sum(dim=1).tolist()
        paths |= int(np_or(info[:, 1]))
    assert paths & (RACE_BUFFER | RACE_PASS | TOPK_MASS) == RACE_BUFFER | RACE_PASS | TOPK_MASS, hex(paths)


def test_the_gpus_tiles_give_the_torch_samplers_token(device):
    """The default capacity, chunk and GPU tiles (in the interpreter too, where `sample` picks
    larger tiles of its own: so the suite's compile check also builds what a GPU launches)."""
    g = _gen("gpu-tiles")
    b, v = 4, 20000
    x, params = _logits(g, b, v, 0), _random_params(g, b, v)
    params[0].update(top_k=-1, top_p=1.0, min_p=0.0)  # one row the stats kernel races alone
    noise = torch.empty(b, v).exponential_(generator=g)
    tiles = ks.default_tiles(v, ks.DEFAULT_CHUNK, interpreted=False)
    tokens, info = _kernel(x, params, noise, device, ks.DEFAULT_CAPACITY, ks.DEFAULT_CHUNK, tiles)
    ref, kept = _reference(x, params, noise)
    assert tokens.tolist() == ref.tolist(), params
    assert info[:, 0].tolist() == kept.sum(dim=1).tolist()


def np_or(col: torch.Tensor) -> int:
    out = 0
    for v in col.tolist():
        out |= v
    return out


@pytest.mark.parametrize("case", ["top_p", "min_p", "top_k_top_p", "large_kept"])
def test_kept_set_matches_sort_based_cut(device, case):
    g = _gen("kept", case)
    b, v = 8, 700
    paths = 0
    for kind in (1, 2, 3):
        x = _logits(g, b, v, kind)
        r = torch.rand(b, 3, generator=g)
        if case == "top_p":
            params = [dict(temperature=0.5 + r[i, 0].item(), top_k=-1, top_p=0.2 + 0.79 * r[i, 1].item(), min_p=0.0)
                      for i in range(b)]
        elif case == "min_p":
            params = [dict(temperature=0.5 + r[i, 0].item(), top_k=-1, top_p=1.0, min_p=r[i, 1].item() ** 4)
                      for i in range(b)]
        elif case == "top_k_top_p":
            params = [dict(temperature=0.5 + r[i, 0].item(), top_k=int(2 + 600 * r[i, 2]),
                           top_p=0.5 + 0.5 * r[i, 1].item(), min_p=0.0) for i in range(b)]
        else:  # near-1 top_p and tiny min_p on flat rows: hundreds kept, cut inside tie groups
            params = [dict(temperature=1.5, top_k=int(300 + 390 * r[i, 2]), top_p=0.99 + 0.0099 * r[i, 1].item(),
                           min_p=1e-4 * r[i, 0].item()) for i in range(b)]
        noise = torch.empty(b, v).exponential_(generator=g)
        tokens, info = _kernel(x, params, noise, device)
        ref, kept = _reference(x, params, noise)
        _check_prefix(x, params, kept, info[:, 0])
        assert tokens.tolist() == ref.tolist()
        paths |= np_or(info[:, 1])
    if case == "large_kept":
        assert paths & RACE_PASS and paths & 0xFFFF00, hex(paths)  # refinement passes and the race pass


def test_the_split_gather_gives_what_the_one_program_gather_gives(device):
    """The first bracket gathered split by split and small brackets sorted narrow (the defaults)
    against the select kernel's own pass over the row and one CAP-wide sort: same tokens, kept
    counts and paths, on rows that take it and rows that refine; the split kernel really
    gathered on some rows (and never with it off)."""
    g = _gen("split-gather")
    b, v = 12, 1500
    for kind in (0, 1, 2):
        x, params = _logits(g, b, v, kind), _random_params(g, b, v)
        params[0].update(top_k=5, top_p=1.0, min_p=0.0)   # a bracket from the top that fits
        params[1].update(top_k=-1, top_p=0.5, min_p=0.0)
        x[:3, torch.randperm(v, generator=g)[:40]] = math.nan  # never kept: as -inf
        x[3] = -math.inf  # 20 finite ids far apart: no pivot cuts, the bracket runs from below every one
        x[3, torch.randperm(v, generator=g)[:20]] = torch.linspace(60.0, -60.0, 20)
        params[3].update(temperature=1.0, top_k=15, top_p=1.0, min_p=0.0)
        noise = torch.empty(b, v).exponential_(generator=g)
        on = _kernel(x, params, noise, device, config=dict(split_gather=True))
        off = _kernel(x, params, noise, device, config=dict(split_gather=False, small_sort=CAP))
        ref, kept = _reference(x.masked_fill(x.isnan(), -math.inf), params, noise)
        assert on[0].tolist() == off[0].tolist() == ref.tolist(), params
        assert on[1][:, 0].tolist() == off[1][:, 0].tolist() == kept.sum(dim=1).tolist()
        assert (on[1][:, 1] & ~SPLIT_GATHERED).tolist() == off[1][:, 1].tolist()
        assert np_or(on[1][:, 1]) & SPLIT_GATHERED and not np_or(off[1][:, 1]) & SPLIT_GATHERED
        assert on[1][0, 1] & SPLIT_GATHERED and on[1][3, 1] & SPLIT_GATHERED, on[1][:, 1].tolist()


def test_top_k_above_the_finite_count_keeps_every_finite_id(device):
    g = _gen("nocut")
    x = _logits(g, 3, 500, 0)
    x[:, 100:] = -math.inf  # 100 finite ids; top_k 300 < V but above them: no cut at all
    params = [dict(temperature=0.7, top_k=300, top_p=1.0, min_p=0.0)] * 3
    noise = torch.empty(3, 500).exponential_(generator=g)
    tokens, info = _kernel(x, params, noise, device)
    ref, kept = _reference(x, params, noise)
    assert tokens.tolist() == ref.tolist() and info[:, 0].tolist() == [100] * 3
    assert all(p & NO_CUT for p in info[:, 1].tolist()), info[:, 1].tolist()


def test_ties_larger_than_the_buffer_are_cut_in_id_order(device):
    """A boundary inside a tie group of more than CAP ids: the first ids of it are kept."""
    v = 600
    x = torch.full((4, v), 0.25)
    x[:, :5] = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0])
    x[1, 5:400] = 0.5  # 395 ties above the rest
    params = [dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0),   # cut at position 50, inside the group
              dict(temperature=1.0, top_k=-1, top_p=0.7, min_p=0.0),   # top-p inside the 0.5 group
              dict(temperature=1.0, top_k=300, top_p=0.6, min_p=0.0),  # S_k from a tie group, then top-p
              dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.06)]  # min-p keeps the whole group
    g = _gen("ties")
    for trial in range(2):
        noise = torch.empty(4, v).exponential_(generator=g)
        tokens, info = _kernel(x, params, noise, device)
        ref, kept = _reference(x, params, noise)
        _check_prefix(x, params, kept, info[:, 0])
        assert tokens.tolist() == ref.tolist()
    assert info[0, 1] & CUT_TIES and info[2, 1] & TOPK_TIES, info[:, 1].tolist()


def test_empirical_distribution_matches_the_filtered_one(device):
    """Chi-square of the kernel path's draws (through Sampler) against softmax of the torch cut."""
    v, n = 400, 300
    g = _gen("stats")
    base = torch.randn(v, generator=g) - 3
    base[[17, 123, 250, 301, 399, 5]] = torch.tensor([2.0, 1.7, 1.4, 1.0, 0.6, 0.2])
    params = dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05)
    logits = base.expand(n, v).contiguous()
    probs = torch.softmax(sm._filter(logits[:1].clone(), [row(**params)])[0].double(), dim=-1)
    support = {i: p for i, p in enumerate(probs.tolist()) if p > 0}
    assert 3 <= len(support) <= 6
    torch.manual_seed(1234)
    if device.type == "cuda":
        torch.cuda.manual_seed(1234)
    tokens = Sampler(use_kernel=True).sample(logits.to(device), [row(**params) for _ in range(n)]).tokens
    counts = Counter(tokens)
    assert set(counts) <= set(support)
    chi2 = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in support.items())
    assert chi2 < 20.5, (chi2, counts, support)  # df <= 5: p ~ 0.001


def _mixed_rows(step, gens):
    """Greedy, penalised, blocked, logprob, seeded and unseeded rows with every filter."""
    return [row(temperature=0.0),
            row(top_k=1, temperature=0.7, generator=gens[0]),
            row(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, generator=gens[1], output=[3, 3, step]),
            row(temperature=1.1, top_p=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                prompt=[1, 2, 5], output=[5, step]),
            row(temperature=0.6, min_p=0.1, logprobs=True, top_logprobs=3, generator=gens[2]),
            row(temperature=1.0, min_tokens=4, eos=[0], stop_token_ids=[7], output=[step]),
            row(temperature=1.3, top_k=7),
            row(temperature=0.8, top_k=900, top_p=0.97, generator=gens[3], logprobs=True)]


def test_kernel_path_matches_the_torch_path_through_sampler(device):
    """Same RNG states in, same SampleResult and same generator states out, step after step."""
    g = _gen("sampler")
    v = 500
    gens_k = [torch.Generator(device=device).manual_seed(10 + i) for i in range(4)]
    gens_t = [torch.Generator(device=device).manual_seed(10 + i) for i in range(4)]
    for step in range(3):
        logits = (_logits(g, 8, v, step % 3) * 2).to(torch.bfloat16).to(device)
        logits[:, 0] = torch.where(logits[:, 0] > -math.inf, logits[:, 0] + 4, logits[:, 0])  # EOS likely
        seed = 77 + step
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        got = Sampler(use_kernel=True).sample(logits, _mixed_rows(step, gens_k))
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        want = Sampler(use_kernel=False).sample(logits, _mixed_rows(step, gens_t))
        assert got.tokens == want.tokens
        assert got.logprobs == want.logprobs
        assert got.top_logprobs == want.top_logprobs
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_k, gens_t))
        assert got.tokens[5] not in (0, 7)  # min_tokens blocking ran before the kernel


def test_sample_async_gives_sample_tokens_without_host_data(device):
    v = 400
    logits = _logits(_gen("async"), 5, v, 1).to(device)
    rows = lambda gen: [row(temperature=0.0), row(temperature=0.8, top_k=20, generator=gen),  # noqa: E731
                        row(top_p=0.9), row(min_p=0.1, temperature=1.2), row(top_k=1)]
    torch.manual_seed(3)
    got = Sampler(use_kernel=True).sample_async(logits, rows(torch.Generator(device=device).manual_seed(1)))
    torch.manual_seed(3)
    want = Sampler(use_kernel=False).sample(logits, rows(torch.Generator(device=device).manual_seed(1))).tokens
    assert got.device == logits.device and got.tolist() == want


def test_seeded_rows_ignore_batch_composition_on_the_kernel_path(device):
    v, steps = 300, 5
    params = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01)

    def sequence(position, others, seed=7):
        gen = torch.Generator(device=device).manual_seed(seed)
        noise = _gen("batch", position, len(others))
        out = []
        for step in range(steps):
            own = torch.randn(v, generator=_gen("own", step)) * 3
            rows = [make(step) for make in others]
            rows.insert(position, row(generator=gen, **params))
            logits = torch.randn(len(rows), v, generator=noise) * 3
            logits[position] = own
            out.append(Sampler(use_kernel=True).sample(logits.to(device), rows).tokens[position])
        return out

    alone = sequence(0, [])
    assert sequence(2, [lambda s: row(temperature=1.0), lambda s: row(temperature=0.0),
                        lambda s: row(top_p=0.5, generator=torch.Generator(device=device).manual_seed(s))]) == alone
    assert sequence(1, [lambda s: row(top_k=3, min_p=0.2)]) == alone
    assert sequence(0, [], seed=8) != alone


def test_seeded_row_consumes_exactly_vocab_exponentials(device):
    v = 64
    g = torch.Generator(device=device).manual_seed(5)
    ref = torch.Generator(device=device).manual_seed(5)
    Sampler(use_kernel=True).sample(torch.randn(3, v).to(device),
                                    [row(top_k=3, generator=g), row(), row(temperature=0.0, generator=g)])
    torch.empty(v, device=device).exponential_(generator=ref)
    assert torch.equal(g.get_state(), ref.get_state())
