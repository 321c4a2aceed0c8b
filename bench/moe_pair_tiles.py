"""Batch-1 fused MoE with the shared expert seated (9 pairs: 8 routed + expert E): gate/up and
down tiles side by side against the table's. At batch 1 the pair-block grid is 9 x I/BLOCK_N
programs; with 64-column tiles that is 288 programs of one CTA per SM each on 132 SMs, a
third wave 18% full (the H200 profile: gate/up 329 µs for 1.21 GB, 3.7 TB/s, where 8 pairs
had run at 4.1). Prints µs per call (CUDA-graph replay), TB/s and the ratio to the table's
config. Run on the lent GPU: python3 -m bench.moe_pair_tiles
"""

from __future__ import annotations

import torch

from backends.kernels import fused_moe as fm
from bench.timing import graph_ms

E, D, I, K = 288, 4096, 2048, 8
CANDIDATES = {  # name: (gate_up overrides, down overrides)
    "table": ({}, {}),
    "gu BN32": (dict(BLOCK_N=32), {}),
    "gu BN16": (dict(BLOCK_N=16), {}),
    "gu BN32 st3": (dict(BLOCK_N=32, num_stages=3), {}),
    "gu BN128 BK64": (dict(BLOCK_N=128, BLOCK_K=64), {}),
    "gu BN32, dn BN32": (dict(BLOCK_N=32), dict(BLOCK_N=32)),
    "gu BN16, dn BN32": (dict(BLOCK_N=16), dict(BLOCK_N=32)),
}


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    wg = torch.randn(E + 1, I, D, device=dev, dtype=torch.bfloat16, generator=g).mul_(D ** -0.5)
    wu = torch.randn(E + 1, I, D, device=dev, dtype=torch.bfloat16, generator=g).mul_(D ** -0.5)
    wd = torch.randn(E + 1, D, I, device=dev, dtype=torch.bfloat16, generator=g).mul_(I ** -0.5)
    x = torch.randn(1, D, device=dev, dtype=torch.bfloat16, generator=g)
    routed = torch.randperm(E, device=dev, generator=g)[:K]
    ids = torch.cat([routed, torch.tensor([E], device=dev)])[None]
    w = torch.cat([torch.rand(1, K, device=dev, generator=g), torch.ones(1, 1, device=dev)], 1)
    nbytes = 3 * (K + 1) * I * D * 2
    ref = fm.fused_moe(x, ids, w, wg, wu, wd, 10.0)
    base = None
    print(f"{'config':<20} {'us':>8} {'TB/s':>6} {'/table':>7} {'max diff':>9}")
    for name, (gu, dn) in CANDIDATES.items():
        cfg = {"gate_up": gu, "down": dn}
        try:
            out = fm.fused_moe(x, ids, w, wg, wu, wd, 10.0, config=cfg)
            us = graph_ms(lambda: fm.fused_moe(x, ids, w, wg, wu, wd, 10.0, config=cfg, out=out)) * 1e3
        except Exception as e:  # a tile that does not fit: say so, go on
            print(f"{name:<20} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        base = base or us
        diff = float((out.float() - ref.float()).abs().max())
        print(f"{name:<20} {us:>8.1f} {nbytes / us / 1e6:>6.2f} {us / base:>7.3f} {diff:>9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
