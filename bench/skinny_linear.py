"""Batch-1 (and few-row) 16-bit linears of the `flash-4l` decode step: cuBLAS against glmrt's Triton
weight-streaming kernel (`fp8_linear.skinny_linear`, with and without programmatic dependent
launch), side by side at each projection's real shape.

Each row times a chain of calls captured in one CUDA graph, so the figure includes the launch
gap a call costs inside the decode step's graph. The chain rotates over enough copies of the
weight to overflow the 50 MB L2 (a repeated small weight would be served from L2). Prints µs per
call, TB/s of weight bytes, and cuBLAS / ours. Run on a CUDA host:

    python3 -m bench.skinny_linear [--rows 1,4]
"""

from __future__ import annotations

import argparse

import torch

from backends.kernels import fp8_linear as f8
from backends.kernels import pdl
from bench.timing import graph_ms

SHAPES = {  # name: (out, in) of the flash-4l decode step (per layer)
    "LM head": (154880, 4096),
    "KDA in_proj": (24896, 4096),
    "KDA o_proj": (4096, 8192),
    "KDA f_b / g_b": (8192, 128),
    "MLA q_a+kv_a": (2048, 4096),
    "MLA q_b": (16384, 1536),
    "MLA q_b + idx wq_b": (20480, 1536),
    "MLA o_proj": (4096, 16384),
    "idx wq_b": (4096, 1536),
    "idx wk": (128, 4096),
    "idx weights": (32, 4096),
}
CHAIN_BYTES = 256 << 20   # weight bytes a chain reads: 5x the L2
MAX_CHAIN = 16


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for n in [int(r) for r in args.rows.split(",")]:
        for name, (out_f, in_f) in SHAPES.items():
            nbytes = out_f * in_f * 2
            copies = max(1, min(MAX_CHAIN, -(-CHAIN_BYTES // nbytes)))
            chain = max(copies, 8)
            ws = [torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=g).mul_(in_f ** -0.5)
                  for _ in range(copies)]
            x = torch.randn(n, in_f, device=dev, dtype=torch.bfloat16, generator=g)
            ref = x @ ws[0].T

            def run(fn):
                return graph_ms(lambda: [fn(x, ws[i % copies]) for i in range(chain)]) * 1e3 / chain

            cublas = run(lambda a, w: a @ w.T)
            pdl.ENABLED = False
            plain = run(f8.skinny_linear)
            pdl.ENABLED = True
            with_pdl = run(f8.skinny_linear)
            err = float((f8.skinny_linear(x, ws[0]).float() - ref.float()).abs().max())
            cfg, s, _ = f8.skinny_config(n, out_f, in_f, f8.sm_count(dev))
            tile = f"BN{cfg['BLOCK_N']} BK{cfg['BLOCK_K']} S{s}"
            rows_out.append((n, name, nbytes, cublas, plain, with_pdl, tile, err))
            del ws
            torch.cuda.empty_cache()
    print(f"\nskinny 16-bit linears on {torch.cuda.get_device_name()} (µs per call in a graph chain; TB/s of weights)")
    print(f"{'rows':>4} {'projection':<14} {'MB':>7} {'cuBLAS':>8} {'ours':>8} {'ours+PDL':>8} {'TB/s':>5} "
          f"{'cuBLAS/ours+PDL':>15} {'tile':>16} {'max diff':>9}")
    for n, name, nbytes, c, o, op, tile, err in rows_out:
        print(f"{n:>4} {name:<14} {nbytes / 1e6:>7.1f} {c:>8.1f} {o:>8.1f} {op:>8.1f} {nbytes / op / 1e6:>5.2f} "
              f"{c / op:>15.2f} {tile:>16} {err:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
