"""What the MoE benches share: the GLM-5.3-Flash MoE shapes, random bf16 / fp8 expert weights,
routed inputs, the table's tile config for a case, and the bytes an expert's weights take.

Imported after `bench.h200.interpret_if_smoke` has run (it imports torch and Triton).
"""

from __future__ import annotations

import torch
import triton

from backends.kernels import fused_moe as fm
from backends.reference import ReferenceOps

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)

FULL = dict(d=4096, i=2048, e=288, k=8, limit=10.0, scaling=2.5)
SMOKE = dict(d=256, i=128, e=16, k=4, limit=10.0, scaling=2.5)


def weights_of(kind: str) -> str:
    """fp8a8 runs the fp8 weights (w8a8: act_fp8=True), bf16g the bf16 weights on grouped GEMMs."""
    return {"fp8a8": "fp8", "bf16g": "bf16"}.get(kind, kind)


def moe_call(kind: str, x, ids, rw, ws, scales, limit, out=None):
    """One MoE call of this kind: fused_moe, or for bf16g grouped_moe (the prefill path)."""
    if kind == "bf16g":
        from backends.kernels import grouped_moe as gm
        return gm.grouped_moe(x, ids, rw, *ws, limit, out=out)
    return fm.fused_moe(x, ids, rw, *ws, limit, scales, BLOCK, out=out, act_fp8=kind == "fp8a8")


def table_config(kind: str, n: int) -> dict:
    return fm.get_config(n, torch.bfloat16, FP8 if weights_of(kind) == "fp8" else torch.bfloat16, kind == "fp8a8")


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def make_weights(dims: dict, dev: torch.device, gd: torch.Generator, kinds=("bf16", "fp8")) -> dict:
    e, d, i = dims["e"], dims["d"], dims["i"]
    shapes = ((e, i, d), (e, i, d), (e, d, i))
    gate_w = torch.randn(e, d, device=dev, generator=gd, dtype=torch.bfloat16).mul_(d ** -0.5)
    bias = torch.randn(e, device=dev, generator=gd).mul_(0.05)
    out = dict(gate_w=gate_w, bias=bias)
    if "bf16" in kinds:
        out["bf16"] = ([torch.randn(s, device=dev, dtype=torch.bfloat16, generator=gd).mul_(s[2] ** -0.5)
                        for s in shapes], None)
    if "fp8" in kinds:
        fp8 = []
        for s in shapes:  # e4m3 values ~N(0, 1), scales ~fan_in^-0.5: weights of the same size as bf16's
            fp8.append(torch.randn(s, device=dev, dtype=torch.bfloat16, generator=gd).to(FP8))
        scales = tuple(torch.rand(e, triton.cdiv(o, BLOCK[0]), triton.cdiv(c, BLOCK[1]), device=dev, generator=gd)
                       .add_(0.5).mul_(c ** -0.5) for (_, o, c) in shapes)
        out["fp8"] = (fp8, scales)
    return out


def make_inputs(n: int, dims: dict, w: dict, dev: torch.device, gd: torch.Generator, sets: int) -> list:
    ops = ReferenceOps()
    out = []
    for _ in range(sets):
        x = torch.randn(n, dims["d"], device=dev, generator=gd, dtype=torch.bfloat16)
        rw, ids = ops.moe_route(x, w["gate_w"], w["bias"], dims["k"], 1, 1, True, dims["scaling"])
        out.append((x, ids, rw))
    return out


def expert_bytes(dims: dict, kind: str) -> float:
    d, i = dims["d"], dims["i"]
    if kind == "bf16":
        return 3 * d * i * 2
    return 3 * d * i + 3 * (d // BLOCK[0]) * (i // BLOCK[1]) * 4
