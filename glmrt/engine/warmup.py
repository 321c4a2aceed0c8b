"""The prefill path's warm-up before traffic: every shape class of prefill and mixed batch run
once, so that Triton and fla compile their variants at start-up and not under load."""

from __future__ import annotations

import time

import torch

from glmrt.engine.config import EngineConfig
from glmrt.engine.ranks import ForwardInputs

# Token counts warm_prefill runs (up to the chunked-prefill size): both sides of each fused-MoE
# tile bucket (32, 256, 1024, 4096), multiples of 16 and not, and mhc's one-launch size (1024+).
# 4: a short prompt takes KDA's in-place recurrent path (backends/kernels/kda.py short_rows) and
# the indexer's per-token update launches: variants of their own (an H200 server compiled them
# on its first 4-token prompt)
PREFILL_WARMUP_SIZES = (1, 4, 31, 32, 255, 256, 1023, 1024, 1100, 4095, 4096, 4097, 8192)


def warm_up_prefill(engine, config: EngineConfig) -> None:
    """Run every prefill shape class of an engine once before traffic (warm_prefill), up to the
    largest chunk and prefill batch the scheduler plans (max_num_batched_tokens caps both)."""
    t0 = time.perf_counter()
    batch = min(config.max_prefill_tokens, config.max_num_batched_tokens or config.max_prefill_tokens)
    try:
        ran = warm_prefill(engine.runner, engine.pages, engine.slots,
                           min(config.chunked_prefill_size, batch, engine.context_length - 128),
                           max_batch_tokens=batch, max_reqs=engine.memory.max_running_requests)
        engine.log(f"warmed the prefill path at {len(ran)} batch shapes ({ran} tokens) in "
                   f"{time.perf_counter() - t0:.1f} s")
    except Exception as e:  # an optimisation only: serve without it, and say why
        engine.log(f"prefill warm-up skipped after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()


def warm_prefill(runner, pages, slots, max_tokens: int, max_batch_tokens: int | None = None,
                 max_reqs: int | None = None) -> list[int]:
    """Run the prefill / mixed-batch forward once per shape class before traffic -> the
    token counts run. Triton compiles a kernel per tile config (the fused MoE's token-count
    buckets) and per integer specialisation (a multiple of 16 or not), and fla's chunked KDA
    picks kernels by the batch's sequences; compiled mid-traffic, each variant stalls every
    running request for seconds (the H200 serving sweep: 10-15 s stalls). So: one request at
    each size up to `max_tokens` (the chunk size), a mixed batch, and batches of many
    prefills (and a decode row) up to `max_batch_tokens` (the prefill token budget) and
    `max_reqs` requests, as a loaded server schedules them. Pages and slots come from the
    managers and go back; prefix-0 rows ignore a slot's old state, so nothing a later
    request reads is left behind."""
    ps = runner.cache.page_size
    sizes = [n for n in PREFILL_WARMUP_SIZES if n <= max_tokens]
    if not sizes:
        return []
    batch_cap = max(max_batch_tokens or max_tokens, max_tokens)
    longest = max(sizes)
    held_pages: list[int] = []
    held_slots: list[int] = []

    def take(tokens: int) -> tuple[list[int], int] | None:
        need = -(-tokens // ps)
        if not pages.can_allocate(need) or slots.num_free < 1:
            return None
        got = pages.allocate(need), slots.allocate()
        held_pages.extend(got[0])
        held_slots.append(got[1])
        return got

    ran = []

    rng = torch.Generator().manual_seed(0)

    def forward(prefix, seq, slot_ids, tables):
        ids = torch.randint(10, 1000, (sum(seq),), generator=rng).tolist()
        ends = torch.tensor(seq).cumsum(0)
        runner.run(ForwardInputs(ids=ids, prefix_lens=prefix, seq_lens=seq, slot_ids=slot_ids,
                               page_tables=tables, logits_rows=(ends - 1).tolist()))
        ran.append(sum(seq))

    try:
        a, b, c = take(longest + 64), take(64), take(64)
        if a is None or b is None or c is None:
            return []
        (pa, sa), (pb, sb), (pc, sc) = a, b, c
        for n in sizes:                      # one request, prefix 0, n tokens
            forward([0], [n], [sa], [pa])
        forward([0], [40], [sc], [pc])       # c gets a prefix for the mixed batch below
        # mixed: an extension after a cached prefix, a new request, a decode row
        forward([longest, 0, 40], [min(33, 64), 17, 1], [sa, sb, sc], [pa, pb, pc])
        forward([0, 0], [min(longest, 64), min(longest, 128) - 1], [sb, sa], [pb, pa])  # two prefills
        # many prefills in one batch (the request count reaches fla's varlen kernels and
        # ours as an integer argument: 3 and 17 are neither 1 nor a multiple of 16, 16, 32
        # and 64 are), chunks of up to 1024 tokens within the batch budget; c adds a decode
        # row on top of the budget, as the scheduler plans decodes beside a full prefill
        # budget (a step of 16 x 1024 prompt tokens and a decode was a mid-traffic stall)
        for n_req, decode in ((3, False), (8, True), (16, True), (17, False), (32, True), (64, False)):
            if max_reqs is not None and n_req + decode > max_reqs:
                break
            per = min(1024, max_tokens, batch_cap // n_req)
            if per < 2:
                break
            got = [take(per) for _ in range(n_req)]
            if any(g is None for g in got):
                break
            rows = [(0, per, s, p) for p, s in got] + ([(40, 1, sc, pc)] if decode else [])
            forward(*(list(col) for col in zip(*rows)))
    finally:
        pages.release(held_pages)
        for sl in held_slots:
            slots.free(sl)
    return ran
