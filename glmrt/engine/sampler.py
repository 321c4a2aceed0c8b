"""The sampler: turn one step's logits [B, V] into one token per row, plus optional logprobs.

Order (vLLM/SGLang semantics, all in fp32): repetition, frequency and presence penalties;
min_tokens blocking of EOS and stop ids; then greedy rows take the argmax (ties go to the
lowest id) and the others divide by temperature, keep top-k, then top-p, then min-p, and draw
by the Gumbel-max trick: argmax(z - log E) with E ~ Exp(1), an exponential race.

Invariant: a seeded row's token depends only on its own logits row and its own generator.
Each seeded draw takes exactly V exponentials from the row's generator, whatever else is in
the batch, and every batched op on it is row-local and deterministic (see `_sample_random`).
Unseeded rows share one batched draw from the global generator.
"""

from __future__ import annotations

import math
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

    # ---- the overlap schedule's path: tokens stay on the device ----------------------------
    @staticmethod
    def can_sample_async(row: SamplerRow) -> bool:
        """Rows whose token needs no host data: no penalties (they read the history), no
        logprobs, min_tokens already met (the blocking reads the output count), greedy."""
        p = row.params
        return (p.is_greedy and not _has_penalties(p) and not p.logprobs
                and len(row.output_ids) >= p.min_tokens)

    def sample_async(self, logits: Tensor, rows: list[SamplerRow]) -> Tensor:
        """Tokens [B] on the device for rows that pass can_sample_async (no host sync)."""
        return logits.argmax(dim=-1)  # first maximum: ties go to the lowest id, as in sample()

    def sample(self, logits: Tensor, rows: list[SamplerRow]) -> SampleResult:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        x = logits.to(torch.float32, copy=True)
        raw_logprobs = torch.log_softmax(x, dim=-1) if any(r.params.logprobs for r in rows) else None
        _apply_penalties(x, rows)
        _block_early_stops(x, rows)

        tokens = torch.zeros(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            idx = torch.tensor(greedy, device=x.device)
            tokens[idx] = x[idx].argmax(dim=-1)  # first maximum: ties go to the lowest id
        if randoms:
            idx = torch.tensor(randoms, device=x.device)
            tokens[idx] = _sample_random(x[idx], [rows[i] for i in randoms])
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
    if any(rows[i].params.repetition_penalty != 1.0 for i in idx):
        rep = _column([rows[i].params.repetition_penalty for i in idx], x.device)
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


def _sample_random(x: Tensor, rows: list[SamplerRow]) -> Tensor:
    """Temperature, top-k, top-p, min-p, then the Gumbel-max draw argmax(z - log Exp(1)).

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
            g = torch.tensor(group, device=x.device)
            drop[g] |= _top_p_drop(sorted_z[g], _column([top_p[j] for j in group], x.device))
        z.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        # p_i < min_p * p_max  <=>  z_i < z_max + log(min_p); the top token always survives
        log_min_p = _column([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], x.device)
        z.masked_fill_(z < z.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))
    return (z - _exponentials(z, rows).log_()).argmax(dim=-1)


def _top_p_drop(sorted_z: Tensor, top_p: Tensor) -> Tensor:
    """Drop all but the smallest prefix of the (top-k renormalised) sorted probs reaching top_p."""
    sorted_p = sorted_z.softmax(dim=-1)
    drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
    drop[:, 0] = False
    return drop


def _exponentials(z: Tensor, rows: list[SamplerRow]) -> Tensor:
    """Exp(1) noise like z: one global draw for unseeded rows, V draws from each row's generator."""
    noise = torch.empty_like(z)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=z.device)
        noise[idx] = torch.empty(len(unseeded), z.shape[1], device=z.device).exponential_()
    for j, r in enumerate(rows):
        if r.generator is not None:
            draw = torch.empty(z.shape[1], device=r.generator.device).exponential_(generator=r.generator)
            noise[j] = draw.to(z.device)
    return noise.clamp_min_(_TINY)


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
