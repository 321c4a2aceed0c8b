"""The sampler: turn one step's logits [B, V] into one token per row, plus optional logprobs.

Order (vLLM/SGLang semantics, all in fp32): repetition, frequency and presence penalties;
min_tokens blocking of EOS and stop ids; then greedy rows take the argmax (ties go to the
lowest id) and the others divide by temperature, keep top-k, then top-p, then min-p, and draw
by an exponential race (argmax of probs / Exp(1) noise, i.e. the Gumbel-max trick).

Invariant: a seeded row's token depends only on its own logits row and its own generator.
Seeded rows are filtered and drawn one at a time on a [1, V] slice, and each draw consumes
exactly V exponentials from that row's generator, whatever else is in the batch. Unseeded
rows share one batched draw from the global generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

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
    """Stateless: all per-request state (history, generator) comes in through the rows."""

    def sample(self, logits: Tensor, rows: list[SamplerRow]) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        x = logits.to(torch.float32, copy=True)
        raw_logprobs = torch.log_softmax(x, dim=-1) if any(r.params.logprobs for r in rows) else None
        _apply_penalties(x, rows)
        _block_early_stops(x, rows)

        tokens = torch.zeros(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        unseeded = [i for i, r in enumerate(rows) if not r.params.is_greedy and r.generator is None]
        seeded = [i for i, r in enumerate(rows) if not r.params.is_greedy and r.generator is not None]
        if greedy:
            idx = torch.tensor(greedy, device=x.device)
            tokens[idx] = x[idx].argmax(dim=-1)  # first maximum: ties go to the lowest id
        if unseeded:
            idx = torch.tensor(unseeded, device=x.device)
            probs = _filtered_probs(x[idx], [rows[i].params for i in unseeded])
            noise = torch.empty_like(probs).exponential_().clamp_min_(_TINY)
            tokens[idx] = probs.div_(noise).argmax(dim=-1)
        for i in seeded:
            probs = _filtered_probs(x[i : i + 1], [rows[i].params])[0]
            tokens[i] = probs.div_(_row_noise(probs.numel(), rows[i].generator, x.device)).argmax()
        return _result(tokens, raw_logprobs, rows)


def _apply_penalties(x: Tensor, rows: list[SamplerRow]) -> None:
    """Repetition (prompt + output), then frequency and presence (output only), in place."""
    idx = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not idx:
        return
    num_rows, vocab = len(idx), x.shape[1]
    sub = x[idx]
    out_ids = _padded_ids([rows[i].output_ids for i in idx], vocab, x.device)
    counts = torch.zeros(num_rows, vocab + 1, device=x.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    rep = _column([rows[i].params.repetition_penalty for i in idx], x.device)
    if (rep != 1).any():
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, _padded_ids([rows[i].prompt_ids for i in idx], vocab, x.device), True)
        seen = seen[:, :vocab] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = _column([rows[i].params.frequency_penalty for i in idx], x.device)
    pres = _column([rows[i].params.presence_penalty for i in idx], x.device)
    sub = sub - freq * counts - pres * (counts > 0).float()
    x[torch.tensor(idx, device=x.device)] = sub


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _block_early_stops(x: Tensor, rows: list[SamplerRow]) -> None:
    """Set EOS and stop ids to -inf while a row has fewer than min_tokens outputs."""
    vocab = x.shape[1]
    for i, r in enumerate(rows):
        if len(r.output_ids) < r.params.min_tokens:
            ids = sorted({t for t in (*r.eos_ids, *r.params.stop_token_ids) if 0 <= t < vocab})
            if ids:
                x[i, torch.tensor(ids, device=x.device)] = float("-inf")


def _filtered_probs(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """softmax(x / T) with top-k, then top-p, then min-p applied; the top token always survives."""
    vocab = x.shape[1]
    z = x / _column([max(p.temperature, _MIN_TEMPERATURE) for p in params], x.device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]  # NOTE: 2.0 keeps all, even if cumsum rounds past 1
    min_p = [p.min_p for p in params]
    if all(k == vocab for k in top_k) and all(p > 1.0 for p in top_p) and not any(min_p):
        return z.softmax(dim=-1)
    sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
    drop = torch.arange(vocab, device=x.device) >= _column(top_k, x.device)
    sorted_p = sorted_z.masked_fill(drop, float("-inf")).softmax(dim=-1)  # renormalised after top-k
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop |= mass_before >= _column(top_p, x.device)  # smallest prefix whose mass reaches top_p
    drop |= sorted_p < _column(min_p, x.device) * sorted_p[:, :1]
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return z.masked_fill_(mask, float("-inf")).softmax(dim=-1)


def _row_noise(vocab: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """V Exp(1) draws from the row's own generator (on its device), clamped away from 0."""
    noise = torch.empty(vocab, device=generator.device).exponential_(generator=generator)
    return noise.to(device).clamp_min_(_TINY)


def _result(tokens: Tensor, raw_logprobs: Tensor | None, rows: list[SamplerRow]) -> SampleResult:
    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * len(rows)
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        for i, r in enumerate(rows):
            if r.params.logprobs:
                logprobs[i] = chosen[i]
        want = [i for i, r in enumerate(rows) if r.params.logprobs and r.params.top_logprobs > 0]
        if want:
            num = min(max(rows[i].params.top_logprobs for i in want), raw_logprobs.shape[1])
            values, ids = raw_logprobs[torch.tensor(want, device=tokens.device)].topk(num, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for j, i in enumerate(want):
                n = rows[i].params.top_logprobs
                top[i] = list(zip(ids[j][:n], values[j][:n]))
    return SampleResult(tokens=token_list, logprobs=logprobs, top_logprobs=top)


def _padded_ids(seqs: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """[len(seqs), max_len] ids; padding and out-of-vocab ids map to the spare column `vocab`."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for j, s in enumerate(seqs):
        if s:
            ids[j, : len(s)] = torch.tensor(s, dtype=torch.long)
    ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
    return ids.to(device)


def _column(values: list[float] | list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]
