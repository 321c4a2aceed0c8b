"""The sampler: turn one step's logits [B, V] into one token per row, plus optional logprobs.

Order (vLLM/SGLang semantics, all in fp32): repetition, frequency and presence penalties;
min_tokens blocking of EOS and stop ids; then greedy rows take the argmax (ties go to the
lowest id) and the others divide by temperature, keep top-k, then top-p, then min-p, and draw
by the Gumbel-max trick: argmax(z - log E) with E ~ Exp(1), an exponential race.

Invariant: a seeded row's token depends only on its own logits row and its own generator.
Each seeded draw takes exactly V exponentials from the row's generator, whatever else is in
the batch, and every batched op on it is row-local and deterministic (see `_sample_random`).
Unseeded rows share one batched draw from the global generator.

Two implementations of the steps after the penalties, picked per call:
* the torch path (sort-based), on any device: the reference;
* the kernel path (`backends.kernels.sampling`, Triton): used by default when the logits are
  on a CUDA device and Triton is installed (GLMRT_SAMPLER_KERNEL=0 turns it off;
  `Sampler(use_kernel=True)` forces it, e.g. on CPU under TRITON_INTERPRET=1). It takes the
  same exponentials, drawn the same way (so the same generator states give the same tokens,
  and a seed gives the same tokens in any batch), and finds the top-k/top-p/min-p cuts by
  threshold search instead of sorting the vocabulary.
Either way nothing in the step waits for the GPU until the one device-to-host copy of the
results (per-row values travel as one host-built tensor each, copied without a sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from glmrt import env
from glmrt.sampling_params import SamplingParams

# NOTE: like vLLM's _SAMPLING_EPS: a tiny positive temperature would overflow logits / T.
_MIN_TEMPERATURE = 1e-5
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerRow:
    """One request's view for this step. `generator` is the request's own, kept across steps."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    eos_ids: list[int] = field(default_factory=list)


@dataclass
class SampleResult:
    """Per row: the token, its raw log-prob and the raw top-N pairs (None where not asked)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Stateless: all per-request state (history, generator) comes in through the rows.

    `use_kernel`: None (default) takes the Triton kernel path for CUDA logits when Triton is
    installed and GLMRT_SAMPLER_KERNEL is not "0"; True always (CPU tensors need
    TRITON_INTERPRET=1); False never.
    """

    def __init__(self, use_kernel: bool | None = None) -> None:
        self.use_kernel = use_kernel

    # ---- the overlap schedule's path: tokens stay on the device ----------------------------
    @staticmethod
    def can_sample_async(p: SamplingParams, num_output: int) -> bool:
        """Rows whose token needs no host data: no penalties (they read the history), no
        logprobs, min_tokens already met (the blocking reads the output count). Greedy and
        temperature/top-k/top-p/min-p rows (seeded or not) qualify: sample_async draws them
        exactly as sample() does."""
        return not _has_penalties(p) and not p.logprobs and num_output >= p.min_tokens

    def sample_async(self, logits: Tensor, rows: list[SamplerRow]) -> Tensor:
        """Tokens [B] on the device for rows that pass can_sample_async (no host sync).

        Also right for rows with temperature/top-k/top-p/min-p (seeded or not): the same
        tokens as `sample` gives, with nothing waiting for the GPU (the kernel path on CUDA).
        """
        if all(r.params.is_greedy for r in rows):
            return logits.argmax(dim=-1)  # first maximum: ties go to the lowest id, as in sample()
        x = logits.to(torch.float32, copy=True)
        _apply_penalties(x, rows)
        _block_early_stops(x, rows)
        return self._tokens(x, rows)

    def sample(self, logits: Tensor, rows: list[SamplerRow]) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        x = logits.to(torch.float32, copy=True)
        raw_logprobs = torch.log_softmax(x, dim=-1) if any(r.params.logprobs for r in rows) else None
        _apply_penalties(x, rows)
        _block_early_stops(x, rows)
        return _result(self._tokens(x, rows), raw_logprobs, rows)

    def probabilities(self, logits: Tensor, rows: list[SamplerRow]) -> Tensor:
        """[B, V] fp32: the distribution `sample` draws each row's token from (penalties,
        min_tokens, temperature, top-k, top-p, min-p); a greedy row's is one-hot on its argmax.
        Speculative decoding's rejection sampling reads it (glmrt.engine.speculative)."""
        x = logits.to(torch.float32, copy=True)
        _apply_penalties(x, rows)
        _block_early_stops(x, rows)
        out = torch.zeros_like(x)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            idx = _upload(torch.tensor(greedy), x.device)
            out[idx, x[idx].argmax(dim=-1)] = 1.0
        if randoms:
            idx = _upload(torch.tensor(randoms), x.device)
            out[idx] = _filter(x[idx], [rows[i] for i in randoms]).softmax(dim=-1)
        return out

    def result(self, logits: Tensor, rows: list[SamplerRow], tokens: list[int]) -> SampleResult:
        """`tokens` chosen elsewhere (speculative decoding's verification), with the logprobs
        `sample` would report for them."""
        raw = torch.log_softmax(logits.float(), dim=-1) if any(r.params.logprobs for r in rows) else None
        return _result(torch.tensor(tokens, dtype=torch.long, device=logits.device), raw, rows)

    def _tokens(self, x: Tensor, rows: list[SamplerRow]) -> Tensor:
        """One token per row of the penalised fp32 logits x, on x's device."""
        if all(r.params.is_greedy for r in rows):  # one argmax launch instead of the kernels' four
            return x.argmax(dim=-1)
        kernels = self._kernels(x)
        if kernels is not None:
            return _sample_kernel(kernels, x, rows)
        tokens = torch.zeros(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            idx = _upload(torch.tensor(greedy), x.device)
            tokens[idx] = x[idx].argmax(dim=-1)  # first maximum: ties go to the lowest id
        if randoms:
            idx = _upload(torch.tensor(randoms), x.device)
            tokens[idx] = _sample_random(x[idx], [rows[i] for i in randoms])
        return tokens

    def _kernels(self, x: Tensor):
        """The Triton sampling module when this call takes the kernel path, else None."""
        if self.use_kernel is False or x.shape[0] == 0:
            return None
        if self.use_kernel is None and (not x.is_cuda or not env.sampler_kernel()):
            return None
        mod = _load_kernels()
        if mod is None and self.use_kernel:
            raise RuntimeError("Sampler(use_kernel=True) needs Triton (backends.kernels.sampling)")
        return mod


_KERNELS: list = []


def _load_kernels():
    """backends.kernels.sampling, imported once; None where Triton is missing."""
    if not _KERNELS:
        try:
            from backends.kernels import sampling
        except ImportError:
            sampling = None
        _KERNELS.append(sampling)
    return _KERNELS[0]


def _sample_kernel(kernels, x: Tensor, rows: list[SamplerRow]) -> Tensor:
    """Greedy and random rows through the Triton kernels, with the torch path's exponentials.

    Noise rows: first the unseeded random rows (one batched draw from the global generator,
    as `_exponentials` draws them), then each seeded row's V draws from its own generator, in
    row order; greedy rows draw nothing.
    """
    vocab = x.shape[1]
    greedy = [r.params.is_greedy for r in rows]
    unseeded = [i for i, r in enumerate(rows) if not greedy[i] and r.generator is None]
    seeded = [i for i, r in enumerate(rows) if not greedy[i] and r.generator is not None]
    noise_row = [-1] * len(rows)
    for j, i in enumerate(unseeded + seeded):
        noise_row[i] = j
    noise = None
    if unseeded or seeded:
        noise = torch.empty(len(unseeded) + len(seeded), vocab, device=x.device)
        if unseeded:
            noise[: len(unseeded)].exponential_()
        for j, i in enumerate(seeded, start=len(unseeded)):
            g = rows[i].generator
            if _same_device(g.device, x.device):
                noise[j].exponential_(generator=g)
            else:
                noise[j].copy_(torch.empty(vocab, device=g.device).exponential_(generator=g))
    params = [r.params for r in rows]
    packed = kernels.pack_params(
        [1.0 if gr else max(p.temperature, _MIN_TEMPERATURE) for p, gr in zip(params, greedy)],
        [vocab if gr else p.top_k for p, gr in zip(params, greedy)],
        [1.0 if gr else p.top_p for p, gr in zip(params, greedy)],
        [0.0 if gr else p.min_p for p, gr in zip(params, greedy)],
        noise_row, vocab)
    return kernels.sample(x, _upload(packed, x.device), noise)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _upload(t: Tensor, device: torch.device) -> Tensor:
    """A host-built tensor on `device`; to a GPU through pinned memory, so nothing waits."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _apply_penalties(x: Tensor, rows: list[SamplerRow]) -> None:
    """Repetition (prompt + output), then frequency and presence (output only), in place."""
    idx = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not idx:
        return
    num_rows, vocab = len(idx), x.shape[1]
    rows_t = _upload(torch.tensor(idx), x.device)
    sub = x.index_select(0, rows_t)
    out_ids = _padded_ids([rows[i].output_ids for i in idx], vocab, x.device)
    counts = torch.zeros(num_rows, vocab + 1, device=x.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    if any(rows[i].params.repetition_penalty != 1.0 for i in idx):
        rep = _column([rows[i].params.repetition_penalty for i in idx], x.device)
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, _padded_ids([rows[i].prompt_ids for i in idx], vocab, x.device), True)
        seen = seen[:, :vocab] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = _column([rows[i].params.frequency_penalty for i in idx], x.device)
    pres = _column([rows[i].params.presence_penalty for i in idx], x.device)
    sub = sub - freq * counts - pres * (counts > 0).float()
    x.index_copy_(0, rows_t, sub)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _block_early_stops(x: Tensor, rows: list[SamplerRow]) -> None:
    """Set EOS and stop ids to -inf while a row has fewer than min_tokens outputs."""
    vocab = x.shape[1]
    flat: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_ids) < r.params.min_tokens:
            flat.extend(i * vocab + t for t in sorted({t for t in (*r.eos_ids, *r.params.stop_token_ids)
                                                       if 0 <= t < vocab}))
    if flat:  # x is a fresh contiguous copy
        x.view(-1).index_fill_(0, _upload(torch.tensor(flat, dtype=torch.long), x.device), float("-inf"))


def _sample_random(x: Tensor, rows: list[SamplerRow]) -> Tensor:
    """Temperature, top-k, top-p, min-p, then the Gumbel-max draw argmax(z - log Exp(1))."""
    z = _filter(x, rows)
    return (z - _exponentials(z, rows).log_()).argmax(dim=-1)


def _filter(x: Tensor, rows: list[SamplerRow]) -> Tensor:
    """z = x / T with everything top-k, top-p and min-p drop set to -inf (the torch path).

    NOTE: every step is elementwise, a max, or an exact (stable) sort, so a row's result does
    not depend on its batch, except top-p's softmax and cumsum: those run per row for seeded
    rows, whose shape is then always [1, V].
    """
    params = [r.params for r in rows]
    vocab = x.shape[1]
    z = x / _column([max(p.temperature, _MIN_TEMPERATURE) for p in params], x.device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]  # 2.0: off, even if cumsum rounds past 1
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
        drop = torch.arange(vocab, device=x.device) >= _column(top_k, x.device)
        sorted_z.masked_fill_(drop, float("-inf"))
        top_p_rows = [j for j, p in enumerate(top_p) if p < 1.0]
        seeded = [j for j in top_p_rows if rows[j].generator is not None]
        unseeded = [j for j in top_p_rows if rows[j].generator is None]
        for group in [[j] for j in seeded] + ([unseeded] if unseeded else []):
            g = _upload(torch.tensor(group), x.device)
            drop[g] |= _top_p_drop(sorted_z[g], _column([top_p[j] for j in group], x.device))
        z.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        # p_i < min_p * p_max  <=>  z_i < z_max + log(min_p); the top token always survives
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], x.device)
        z.masked_fill_(z < z.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))
    return z


def _top_p_drop(sorted_z: Tensor, top_p: Tensor) -> Tensor:
    """Drop all but the smallest prefix of the (top-k renormalised) sorted probs reaching top_p."""
    sorted_p = sorted_z.softmax(dim=-1)
    drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
    drop[:, 0] = False
    return drop


def advance_generator(generator: torch.Generator, vocab: int, num_sampled: int) -> None:
    """Move a seeded row's generator past `num_sampled` tokens it drew elsewhere (each took V
    exponentials, the invariant above), so a request continued by another engine (the decode
    side of a handoff) draws on as if it had sampled them here."""
    for _ in range(num_sampled):
        torch.empty(vocab, device=generator.device).exponential_(generator=generator)


def _exponentials(z: Tensor, rows: list[SamplerRow]) -> Tensor:
    """Exp(1) noise like z: one global draw for unseeded rows, V draws from each row's generator."""
    noise = torch.empty_like(z)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        idx = _upload(torch.tensor(unseeded), z.device)
        noise[idx] = torch.empty(len(unseeded), z.shape[1], device=z.device).exponential_()
    for j, r in enumerate(rows):
        if r.generator is not None:
            draw = torch.empty(z.shape[1], device=r.generator.device).exponential_(generator=r.generator)
            noise[j] = draw.to(z.device)
    return noise.clamp_min_(_TINY)


def _result(tokens: Tensor, raw_logprobs: Tensor | None, rows: list[SamplerRow]) -> SampleResult:
    """Everything the host needs (tokens, chosen and top-N logprobs) in one device-to-host copy."""
    num = len(rows)
    parts = [tokens.to(torch.float64)]
    want: list[int] = []
    width = 0
    if raw_logprobs is not None:
        parts.append(raw_logprobs.gather(1, tokens[:, None])[:, 0].to(torch.float64))
        want = [i for i, r in enumerate(rows) if r.params.logprobs and r.params.top_logprobs > 0]
        if want:
            width = min(max(rows[i].params.top_logprobs for i in want), raw_logprobs.shape[1])
            sel = raw_logprobs if len(want) == num else raw_logprobs.index_select(
                0, _upload(torch.tensor(want), raw_logprobs.device))
            values, ids = sel.topk(width, dim=-1)
            parts += [values.to(torch.float64).flatten(), ids.to(torch.float64).flatten()]
    flat = torch.cat(parts).tolist() if num else []  # the one sync of the step
    token_list = [int(t) for t in flat[:num]]
    logprobs: list[float | None] = [None] * num
    top: list[list[tuple[int, float]] | None] = [None] * num
    if raw_logprobs is not None:
        chosen = flat[num: 2 * num]
        for i, r in enumerate(rows):
            if r.params.logprobs:
                logprobs[i] = chosen[i]
        base = 2 * num
        for j, i in enumerate(want):
            n = rows[i].params.top_logprobs
            values = flat[base + j * width: base + j * width + n]
            ids = flat[base + len(want) * width + j * width: base + len(want) * width + j * width + n]
            top[i] = [(int(t), v) for t, v in zip(ids, values)]
    return SampleResult(tokens=token_list, logprobs=logprobs, top_logprobs=top)


def _padded_ids(seqs: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """[len(seqs), max_len] ids; padding and out-of-vocab ids map to the spare column `vocab`."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for j, s in enumerate(seqs):
        if s:
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    return _upload(ids, device)


def _column(values: list[float] | list[int], device: torch.device) -> Tensor:
    return _upload(torch.tensor(values, dtype=torch.float32), device)[:, None]
