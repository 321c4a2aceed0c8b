"""What an L2 prefetch of a GEMV's weights saves when a chain of small kernels runs before it.

Each row times, in one CUDA graph (PDL on, as in the batch-1 decode step), segments of
`chain` RMSNorms of one 8192-wide row followed by a one-row linear over one of several weight
copies (rotated past the L2), with `prefetch_l2` of the first MB of that segment's weight
launched after the first norm, or not at all (0 MB). The saving is the difference per segment.

    python3 -m bench.l2_prefetch [--shapes "KDA o_proj,MLA o_proj"] [--weights bf16,fp8]
                                 [--chain 1,3,6] [--mb 0,8,16,32] [--pdl on,off] [--mode line,sector,bulk]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from backends.kernels import fp8_linear as f8
from backends.kernels import pdl, prefetch
from backends.kernels.norms import rms_norm
from bench.h200 import CEILING_TBPS, write_out
from bench.skinny_linear import SHAPES
from bench.timing import graph_ms

CHAIN_BYTES = 256 << 20  # weight bytes the copies span: 5x the L2


def weights(out_f: int, in_f: int, kind: str, copies: int, g: torch.Generator, dev) -> list[tuple]:
    """`copies` (weight, scale_inv or None) pairs of one projection."""
    got = []
    for _ in range(copies):
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=g).mul_(in_f ** -0.5)
        if kind == "fp8":
            s = torch.full(((out_f + 127) // 128, (in_f + 127) // 128), 1 / 64, device=dev)
            got.append(((w * 64).to(torch.float8_e4m3fn), s))
        else:
            got.append((w, None))
    return got


def linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    if s is None:
        return f8.skinny_linear(x, w)
    return f8.fp8_linear(x, w, s, act_fp8=True)


def segment_us(x, ws, norm_w, chain: int, mb: float) -> float:
    """µs per (chain norms + linear) segment, the segments over every weight copy in one graph."""
    h = torch.empty(1, norm_w.shape[0], dtype=torch.bfloat16, device=x.device)
    rounds = max(len(ws), 8)

    def step():
        for i in range(rounds):
            w, s = ws[i % len(ws)]
            rms_norm(h, norm_w, 1e-6, out=h)
            if mb:
                prefetch.prefetch_l2([w], int(mb * (1 << 20)))
            for _ in range(chain - 1):
                rms_norm(h, norm_w, 1e-6, out=h)
            linear(x, w, s)

    return graph_ms(step) * 1e3 / rounds


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="KDA o_proj,MLA o_proj,KDA in_proj,MLA q_a+kv_a")
    p.add_argument("--weights", default="bf16,fp8")
    p.add_argument("--chain", default="1,3,6", help="small kernels before the linear (the prefetch after the first)")
    p.add_argument("--mb", default="0,8,16,32", help="MB of the weight prefetched (0: no prefetch)")
    p.add_argument("--pdl", default="on,off")
    p.add_argument("--mode", default="line,sector,bulk", help="prefetch.MODE values side by side")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    norm_w = torch.ones(8192, dtype=torch.bfloat16, device=dev)
    rows = []
    for kind in args.weights.split(","):
        for name in args.shapes.split(","):
            out_f, in_f = SHAPES[name]
            nbytes = out_f * in_f * (1 if kind == "fp8" else 2)
            ws = weights(out_f, in_f, kind, max(2, min(16, -(-CHAIN_BYTES // nbytes))), g, dev)
            x = torch.randn(1, in_f, device=dev, dtype=torch.bfloat16, generator=g)
            for mode in args.pdl.split(","):
                pdl.ENABLED = mode == "on"
                for chain in (int(c) for c in args.chain.split(",")):
                    base = None
                    for mb, how in itertools.product((float(m) for m in args.mb.split(",")), args.mode.split(",")):
                        if not mb and how != args.mode.split(",")[0]:
                            continue  # no prefetch: one row
                        prefetch.MODE = how
                        us = segment_us(x, ws, norm_w, chain, mb)
                        base = us if base is None else base
                        row = dict(weights=kind, shape=name, mb_weight=nbytes / 1e6, pdl=mode, chain=chain,
                                   prefetch_mb=mb, mode=how if mb else "-", us=us, saved_us=base - us,
                                   floor_us=nbytes / (CEILING_TBPS * 1e12) * 1e6)
                        rows.append(row)
                        print(row, flush=True)
            pdl.ENABLED, prefetch.MODE = True, prefetch.DEFAULT_MODE
            del ws
            torch.cuda.empty_cache()
    write_out("l2_prefetch.json", rows)
    print(f"\nL2 prefetch before a one-row linear, {torch.cuda.get_device_name()} (µs per segment of `chain` "
          f"RMSNorms + the linear; saved: against the first --mb value)")
    print(f"{'weights':>7} {'shape':>14} {'MB':>6} {'pdl':>4} {'chain':>5} {'prefetch MB':>11} {'mode':>6} {'µs':>7} "
          f"{'saved µs':>8} {'linear floor µs':>15}")
    for r in rows:
        print(f"{r['weights']:>7} {r['shape']:>14} {r['mb_weight']:>6.1f} {r['pdl']:>4} {r['chain']:>5} "
              f"{r['prefetch_mb']:>11.0f} {r['mode']:>6} {r['us']:>7.1f} {r['saved_us']:>8.1f} {r['floor_us']:>15.1f}")
    return rows


if __name__ == "__main__":
    main()
