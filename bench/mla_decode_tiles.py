"""The sparse-MLA decode kernel at small batches, across tiles and split counts, both ways a
decode query can find its latent rows.

In the batch-1 decode step of `flash-4l` (context 1024) the call took 52 µs for ~1 MB of latent
rows (bench.decode_profile, sixth session): latency, not bytes. Each row here is a chain of
calls in one CUDA graph (µs per call, the merge launch included): the rows derived inside the
attention kernel (`sparse_mla_decode_sel`) beside the row-list kernel plus the attention on its
list (`build_decode_rows` + `sparse_mla_decode`, the decode default since this bench). Full
size: 64 heads, R 512, kpool 16, 128 selected pools + the tail, page size 64.

    python3 -m bench.mla_decode_tiles [--batches 1,16] [--context 1024]
"""

from __future__ import annotations

import argparse

import torch

from backends.kernels import sparse_mla as sm
from backends.meta import BatchMeta
from bench.timing import graph_ms

H, R, KPOOL, NSEL, PAGE = 64, 512, 16, 128, 64
VARIANTS = {  # name: (config overrides, num_splits)
    "default": ({}, None),
    "splits 16": ({}, 16),
    "splits 64": ({}, 64),
    "BN16": (dict(BLOCK_N=16), None),
    "BN64": (dict(BLOCK_N=64), None),
        "BH32 w4": (dict(BLOCK_H=32, num_warps=4), None),
    "BH32 w8": (dict(BLOCK_H=32, num_warps=8), None),
    "BH16 w4": (dict(BLOCK_H=16, num_warps=4), None),
    "1 stage": (dict(num_stages=1), None),
    "3 stages": (dict(num_stages=3), None),
    "w4": (dict(num_warps=4), None),
}
CHAIN = 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        ctx = args.context
        pages_per = -(-(ctx + 1) // PAGE)
        perm = torch.randperm(b * pages_per, generator=g)
        pages = [perm[i * pages_per:(i + 1) * pages_per].tolist() for i in range(b)]
        meta = BatchMeta.build([ctx] * b, [1] * b, list(range(b)), pages, PAGE, dev)
        cache = torch.randn(b * pages_per, PAGE, R, generator=g).to(dev, torch.bfloat16)
        q_abs = torch.randn(b, H, R, generator=g).to(dev, torch.bfloat16)
        complete = (ctx + 1) // KPOOL
        sel = torch.full((b, NSEL), -1, dtype=torch.long)  # the indexer's dtype
        for i in range(b):
            pick = torch.randperm(complete, generator=g)[:NSEL]
            sel[i, :pick.numel()] = pick
        sel = sel.to(dev)
        scale = (256 ** -0.5) * 1.4426950408889634
        ref = sm.sparse_mla_decode_sel(q_abs, cache, sel, meta, KPOOL, scale)
        pos, table = meta.positions, meta.page_table

        def rows_then_list(cfg, splits):
            idx, ntok = sm.build_decode_rows(sel, pos, table, PAGE, KPOOL)
            return sm.sparse_mla_decode(q_abs, cache, idx, scale, ntok, config=cfg, num_splits=splits)
        for name, (cfg, splits) in VARIANTS.items():
            try:
                out = sm.sparse_mla_decode_sel(q_abs, cache, sel, meta, KPOOL, scale, config=cfg, num_splits=splits)
                us = graph_ms(lambda: [sm.sparse_mla_decode_sel(q_abs, cache, sel, meta, KPOOL, scale, config=cfg,
                                                                num_splits=splits) for _ in range(CHAIN)]) * 1e3 / CHAIN
                lst = graph_ms(lambda: [rows_then_list(cfg, splits) for _ in range(CHAIN)]) * 1e3 / CHAIN
            except Exception as e:  # a tile that does not compile: say so, go on
                print(f"b={b} {name}: failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            err = max(float((out.float() - ref.float()).abs().max()),
                      float((rows_then_list(cfg, splits).float() - ref.float()).abs().max()))
            rows.append((b, name, us, lst, err))
        print(f"batch {b} done", flush=True)
    print(f"\nsparse-MLA decode on {torch.cuda.get_device_name()}, context {args.context} "
          "(µs per call, merge included)")
    print(f"{'batch':>5} {'variant':<16} {'in-kernel':>9} {'rows+list':>9} {'/default':>8} {'max diff':>9}")
    base = {}
    for b, name, us, lst, err in rows:
        base.setdefault(b, us)
        print(f"{b:>5} {name:<16} {us:>9.1f} {lst:>9.1f} {us / base[b]:>8.2f} {err:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
