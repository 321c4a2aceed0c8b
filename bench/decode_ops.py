"""Launch shapes of the few-row decode ops of the `flash-4l` step, side by side in one run.

Each row times a chain of calls captured in one CUDA graph (PDL as in the decode step), so a
figure includes the launch gap the op costs inside the step's graph:

- `mla`: the sparse-MLA decode (row list + attention + split merge) at batch 1 over the
  selection the decode step builds (complete pools + tail; `--contexts`), per block shape and
  split count;
- `linear`: the 16-bit weight-streaming linear at the step's projection shapes, per tile and
  split-K count, against cuBLAS; the chain rotates weight copies past the L2;
- `fp8`: the fp8 (w8a8) linear at the step's fp8 projection shapes and `--rows`, per tile and
  split count, as the step calls it (with `act_quant` first past 16 rows); the chain rotates
  weight copies past the L2;
- `route`: the MoE router's logits + selection at one token, per K split count.

    python3 -m bench.decode_ops [--only mla,linear,fp8,route] [--contexts 1024,4096] [--rows 1,16,64,128]
"""

from __future__ import annotations

import argparse

import torch

from backends.kernels import fp8_linear as f8
from backends.kernels import moe_route as mr
from backends.kernels import pdl
from backends.kernels import sparse_mla as sm
from bench.skinny_linear import SHAPES
from bench.timing import graph_ms

MLA_CONFIGS = [  # BLOCK_H, BLOCK_N, num_warps, num_stages
    (64, 32, 8, 2), (64, 16, 8, 2), (64, 64, 8, 2), (64, 32, 8, 1),
    (32, 32, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2), (32, 64, 8, 2),
    (16, 32, 4, 2), (16, 64, 4, 2), (16, 16, 4, 2), (16, 32, 2, 2),
]
MLA_SPLITS = (None, 2, 4, 8, 16, 32)
LINEAR_SHAPES = {name: SHAPES[name] for name in  # the step's projections whose tile is in question
                 ("KDA in_proj", "KDA o_proj", "MLA q_a+kv_a", "MLA q_b", "MLA o_proj", "idx wq_b",
                  "MLA q_b + idx wq_b")}
LINEAR_TILES = [  # BLOCK_N, BLOCK_K, num_warps, num_stages, splits (None: the default split)
    (16, 512, 4, 4, None), (32, 256, 4, 4, None), (64, 128, 4, 4, None), (64, 256, 4, 4, None),
    (32, 256, 4, 6, None), (16, 256, 4, 6, None), (32, 512, 8, 3, None), (64, 256, 8, 3, None),
    (16, 512, 4, 4, 2), (32, 256, 4, 4, 2), (64, 128, 4, 4, 4), (32, 256, 4, 4, 4), (64, 256, 4, 4, 2),
    (128, 128, 4, 4, 4), (128, 128, 8, 4, 8),
]
FP8_SHAPES = {name: SHAPES[name] for name in  # the step's fp8 projections (out, in)
              ("KDA in_proj", "KDA o_proj", "MLA q_a+kv_a", "MLA q_b", "MLA o_proj", "idx wq_b",
               "MLA q_b + idx wq_b")}
# BLOCK_M, BLOCK_N, num_warps, num_stages, SWAP_AB, splits (None: the default split)
FP8_TILES_FEW = [  # up to 16 rows (the default is A8_DECODE_CONFIG: 16, 128, 4, 3, swapped)
    (16, 128, 4, 4, True, None), (16, 128, 4, 6, True, None), (16, 64, 4, 4, True, None),
    (16, 256, 8, 3, True, None), (16, 128, 8, 4, True, None), (16, 128, 4, 4, True, 1),
    (16, 128, 4, 4, True, 4), (16, 64, 4, 4, True, 4),
]
FP8_TILES_MANY = [  # 17-256 rows (the default is the table's 64, 64, 4, 4 on act_quant's output)
    (64, 128, 4, 3, True, None), (64, 128, 4, 4, True, None), (64, 64, 4, 4, True, None),
    (128, 64, 4, 3, True, None), (64, 128, 4, 4, True, 4), (64, 64, 4, 4, False, 2),
]
CHAIN_BYTES = 256 << 20
HEADS, RANK, KPOOL, TOPK_POOLS, PAGE = 64, 512, 16, 128, 64


def _mla_inputs(ctx: int, dev: torch.device, g: torch.Generator):
    pages = -(-ctx // PAGE) + 1
    pool_pages = pages * 8  # the request's pages scattered over a larger pool
    cache = torch.randn(pool_pages, PAGE, RANK, device=dev, generator=g).bfloat16()
    table = torch.randperm(pool_pages, device=dev, generator=g)[:pages].to(torch.int32)[None]
    pos = torch.tensor([ctx - 1], device=dev)
    complete = ctx // KPOOL
    if complete <= TOPK_POOLS:
        sel = torch.full((1, TOPK_POOLS), -1, dtype=torch.long, device=dev)
        sel[0, :complete] = torch.arange(complete, device=dev)
    else:
        sel = torch.randperm(complete, device=dev, generator=g)[:TOPK_POOLS][None]
    q = torch.randn(1, HEADS, RANK, device=dev, generator=g).bfloat16()
    return cache, table, pos, sel, q


def run_mla(contexts, dev) -> list[tuple]:
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for ctx in contexts:
        cache, table, pos, sel, q = _mla_inputs(ctx, dev, g)
        o = torch.empty(1, HEADS, RANK, dtype=torch.bfloat16, device=dev)
        ref = None
        for bh, bn, w, st in MLA_CONFIGS:
            cfg = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st)
            for s in MLA_SPLITS:
                def step():
                    idx, ntok = sm.build_decode_rows(sel, pos, table, PAGE, KPOOL, True)
                    sm.sparse_mla_decode(q, cache, idx, 1 / 16, ntok, out=o, config=cfg, num_splits=s)
                try:
                    step()
                    err = 0.0 if ref is None else float((o.float() - ref).abs().max())
                    if ref is None:
                        ref = o.float().clone()
                    us = graph_ms(lambda: [step() for _ in range(8)]) * 1e3 / 8
                    out.append((ctx, f"H{bh} N{bn} w{w} s{st}", s or "auto", us, err))
                except Exception as e:  # a shape that does not compile is a result too
                    out.append((ctx, f"H{bh} N{bn} w{w} s{st}", s or "auto", float("nan"), str(e)[:40]))
                print("mla", out[-1], flush=True)
    return out


def run_linear(dev) -> list[tuple]:
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    sms = f8.sm_count(dev)
    for name, (out_f, in_f) in LINEAR_SHAPES.items():
        nbytes = out_f * in_f * 2
        copies = max(1, min(16, -(-CHAIN_BYTES // nbytes)))
        chain = max(copies, 8)
        ws = [torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=g).mul_(in_f ** -0.5)
              for _ in range(copies)]
        x = torch.randn(1, in_f, device=dev, dtype=torch.bfloat16, generator=g)
        ref = (x @ ws[0].T).float()

        def chain_us(fn):
            return graph_ms(lambda: [fn(ws[i % copies]) for i in range(chain)]) * 1e3 / chain

        cublas = chain_us(lambda w: x @ w.T)
        cfg, s, _ = f8.skinny_config(1, out_f, in_f, sms)
        out.append((name, nbytes, "cuBLAS", cublas, 0.0))
        out.append((name, nbytes, f"default BN{cfg['BLOCK_N']} BK{cfg['BLOCK_K']} S{s}",
                    chain_us(lambda w: f8.skinny_linear(x, w)), 0.0))
        for bn, bk, nw, st, sp in LINEAR_TILES:
            if bk > in_f:
                continue
            c = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st)
            label = f"BN{bn} BK{bk} w{nw} s{st} S{sp or 'd'}"
            try:
                y = f8.skinny_linear(x, ws[0], config=c, splits=sp)
                err = float((y.float() - ref).abs().max())
                out.append((name, nbytes, label, chain_us(lambda w: f8.skinny_linear(x, w, config=c, splits=sp)), err))
            except Exception as e:
                out.append((name, nbytes, label, float("nan"), str(e)[:40]))
            print("linear", out[-1], flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return out


def run_fp8(dev, rows_list) -> list[tuple]:
    """(shape, rows, MB, variant, µs, max diff against the default) per fp8 linear variant."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, (out_f, in_f) in FP8_SHAPES.items():
        nbytes = out_f * in_f
        copies = max(1, min(16, -(-CHAIN_BYTES // nbytes)))
        chain = max(copies, 8)
        ws = [torch.randn(out_f, in_f, device=dev, generator=g).to(torch.float8_e4m3fn) for _ in range(copies)]
        sc = torch.rand(-(-out_f // 128), -(-in_f // 128), device=dev, generator=g) * in_f ** -0.5
        for rows in rows_list:
            x = torch.randn(rows, in_f, device=dev, dtype=torch.bfloat16, generator=g)
            ref = None
            tiles = FP8_TILES_FEW if rows <= f8.A8_DECODE_MAX_ROWS else FP8_TILES_MANY
            for v in [None] + tiles:
                cfg, sp, label = None, None, "default"
                if v is not None:
                    bm, bn, nw, st, swap, sp = v
                    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st, SWAP_AB=swap)
                    label = f"M{bm} N{bn} w{nw} s{st}{' swap' if swap else ''} S{sp or 'd'}"

                def call(w):
                    return f8.fp8_linear(x, w, sc, (128, 128), None, config=cfg, splits=sp, act_fp8=True)
                try:
                    y = call(ws[0]).float()
                    err = 0.0 if ref is None else float((y - ref).abs().max())
                    ref = y if ref is None else ref
                    us = graph_ms(lambda: [call(ws[i % copies]) for i in range(chain)]) * 1e3 / chain
                    out.append((name, rows, nbytes, label, us, err))
                except Exception as e:  # a tile that does not compile is a result too
                    out.append((name, rows, nbytes, label, float("nan"), str(e)[:40]))
                print("fp8", out[-1], flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return out


def run_route(dev) -> list[tuple]:
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 4096, device=dev, generator=g).bfloat16()
    bias = torch.randn(288, device=dev, generator=g) * 0.01
    out = []
    for wdt in (torch.bfloat16,):  # the router's weight is in the model dtype
        gw = (torch.randn(288, 4096, device=dev, generator=g) * 0.02).to(wdt)
        ref = mr.moe_route(x, gw, bias, 8, True, 2.5)
        for max_split in (8, 16, 32):
            mr._MAX_SPLIT = max_split
            for s in sorted({1, 2, 4, 8, 14, 16, 32} & set(range(1, max_split + 1))):
                w, ids = mr.moe_route(x, gw, bias, 8, True, 2.5, splits=s)
                same = bool(torch.equal(ids, ref[1]))
                us = graph_ms(lambda: [mr.moe_route(x, gw, bias, 8, True, 2.5, splits=s) for _ in range(8)]) * 1e3 / 8
                out.append((str(wdt).split(".")[-1], max_split, s, us, same))
                print("route", out[-1], flush=True)
        mr._MAX_SPLIT = 8
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="mla,linear,fp8,route")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--rows", default="1,16,64,128", help="fp8: token rows")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    pdl.ENABLED = True
    only = set(args.only.split(","))
    mla = run_mla([int(c) for c in args.contexts.split(",")], dev) if "mla" in only else []
    lin = run_linear(dev) if "linear" in only else []
    fp8 = run_fp8(dev, [int(r) for r in args.rows.split(",")]) if "fp8" in only else []
    route = run_route(dev) if "route" in only else []
    if mla:
        print("\nsparse-MLA decode, batch 1 (row list + attention + merge), µs per call in a graph chain")
        for ctx in sorted({r[0] for r in mla}):
            rows = sorted((r for r in mla if r[0] == ctx and r[3] == r[3]), key=lambda r: r[3])
            base = next(r for r in mla if r[0] == ctx and r[2] == "auto")
            print(f"  context {ctx}: default {base[1]} auto {base[3]:.1f} µs")
            for r in rows[:8]:
                print(f"    {r[1]:<16} splits {r[2]!s:>4} {r[3]:7.1f} µs  max diff {r[4]}")
    if lin:
        print("\n16-bit linears at one row, µs per call in a graph chain (TB/s of weights)")
        for name in LINEAR_SHAPES:
            rows = [r for r in lin if r[0] == name]
            if not rows:
                continue
            nbytes = rows[0][1]
            best = sorted((r for r in rows if r[3] == r[3]), key=lambda r: r[3])[:5]
            head = " | ".join(f"{r[2]} {r[3]:.1f}" for r in rows[:2])
            print(f"  {name} ({nbytes / 1e6:.1f} MB, floor {nbytes / 4.09e6:.1f} µs): {head}")
            for r in best:
                print(f"    {r[2]:<28} {r[3]:7.1f} µs {nbytes / r[3] / 1e6:5.2f} TB/s  max diff {r[4]}")
    if fp8:
        print("\nfp8 (w8a8) linears, µs per call in a graph chain (TB/s of weights): the default, then the best 4")
        for name in FP8_SHAPES:
            for rows in sorted({r[1] for r in fp8}):
                rs = [r for r in fp8 if r[0] == name and r[1] == rows]
                if not rs:
                    continue
                nbytes = rs[0][2]
                best = sorted((r for r in rs if r[4] == r[4]), key=lambda r: r[4])[:4]
                print(f"  {name} x {rows} rows ({nbytes / 1e6:.1f} MB, floor {nbytes / 4.09e6:.1f} µs): "
                      + " | ".join(f"{r[3]} {r[4]:.1f}" for r in rs[:2]))
                for r in best:
                    print(f"    {r[3]:<30} {r[4]:7.1f} µs {nbytes / r[4] / 1e6:5.2f} TB/s  max diff {r[5]}")
    if route:
        print("\nMoE router at one token (288 experts, top 8), µs per call in a graph chain")
        for r in route:
            print(f"  weight {r[0]} MAX_SPLIT {r[1]:>2} splits {r[2]:>2}: {r[3]:6.2f} µs  ids equal {r[4]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
