"""The fused MoE's prefill GEMMs on expert-sorted rows with TMA tile loads (SM90+, 16-bit weights).

fused_moe's grouped GEMMs gather their x rows through per-row pointers in every program (each of
the I / BLOCK_N programs of a block loads the same scattered rows again) and load the weight tiles
the same way. At prefill sizes (fused_moe.TMA_MIN_TOKENS tokens and up) fused_moe hands 16-bit
weights to `grouped_gemms` here instead, after the same alignment (moe_align: pairs grouped by
expert, each expert's group padded to BLOCK_M rows):

  1. _gather_kernel    xs[r] = x[sorted[r] // top_k]: the blocks' rows in sorted order, once, so
                       that each BLOCK_M x BLOCK_K tile is one rectangle (padding rows are zero).
                       With A_TMA=False this step is skipped and gate/up gathers x itself.
  2. _gate_up_kernel   TMA loads of the xs tile and of the gate and up weight tiles ([E*I, D]
                       views: expert e's rows start at e*I), two fp32 accumulators, the clamped
                       SwiGLU in the epilogue with the reference's roundings; h in sorted order
                       [blocks*BLOCK_M, I], stored by TMA.
  3. _down_kernel      TMA loads of h's tile (already sorted: no gather) and of W_down's ([E*D, I]
                       view); times the routing weight; each real row stored at its pair's row of
                       ybuf [N*top_k, D] (fused_moe's layout: its _sum_kernel or mhc_post reduce it).

A weight tile that runs past its expert's I (or D) rows reads the next expert's rows: only the
output columns past I (D) depend on them, and the TMA store (the masked store) drops those.
Along K, TMA fills past the tensor's edge with zeros. WARP_SPECIALIZE asks Triton to split each
K loop into a TMA producer and MMA consumers (a config key; off unless a sweep shows a gain).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from . import pdl
from .interpreter import interpreting, patch_interpreter
from .pdl import pdl_enter

patch_interpreter()

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: fused_moe keeps its pointer GEMMs
    TensorDescriptor = None

# Tiles for 16K tokens: the pointer GEMMs' measured best (fused_moe_configs.CONFIGS' last row) as a start;
# untimed on an H200 (bench.moe_h200 --tma-sweep times the alternatives).
CONFIG = dict(BLOCK_M=128, A_TMA=True,
              gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
              down=dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4))


def merged_config(overrides: dict | None = None) -> dict:
    """CONFIG with a caller's changes (top-level keys, and per GEMM under "gate_up" / "down"):
    a fresh copy either way."""
    overrides = overrides or {}
    cfg = {**CONFIG, **overrides}
    for part in ("gate_up", "down"):
        cfg[part] = {**CONFIG[part], **overrides.get(part, {})}
    return cfg


def available(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether these (already fused_moe.supported) arguments can take the TMA path: 16-bit x and
    weights of x's dtype, weights contiguous (the [E*rows, K] views), rows 16-byte aligned (TMA),
    and a device with TMA (SM90+) or the interpreter."""
    if TensorDescriptor is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if any(w.dtype != x.dtype or not w.is_contiguous() for w in (w_gate, w_up, w_down)):
        return False
    e, i, d = w_gate.shape
    if (i * x.element_size()) % 16 or (d * x.element_size()) % 16:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device)[0] >= 9
    return interpreting()


@triton.jit(do_not_specialize=["num_blocks"])
def _gather_kernel(X, XS, SORTED, BLOCK_EXPERT, BLOCK_ROWS, D, top_k, num_blocks, stride_xm, stride_sm,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """xs[block rows] = x[token of each sorted pair]; padding rows zero; blocks past the end skipped."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    if tl.load(BLOCK_EXPERT + pid_m) < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
    pair = tl.load(SORTED + pid_m * BLOCK_M + offs_m, mask=row_ok, other=0).to(tl.int64)
    tok = pair // top_k
    rows = pid_m.to(tl.int64) * BLOCK_M + offs_m
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    v = tl.load(X + tok[:, None] * stride_xm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    tl.store(XS + rows[:, None] * stride_sm + offs_d[None, :], v, mask=d_ok[None, :])


@triton.jit
def _block_tile(BLOCK_EXPERT, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(block, N tile, expert) of this program: GROUP_M consecutive blocks (mostly one expert's)
    sweep the N tiles together, so an expert's weight tiles are reused from L2. Expert -1: a block
    past the end of the aligned list (the caller returns)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    return pid_m, (pid % in_group) // size_m, tl.load(BLOCK_EXPERT + pid_m)


@triton.jit
def swiglu_clamped(g, u, limit, HAS_LIMIT: tl.constexpr):
    """h = silu(min(g, limit)) · clamp(u, ±limit) from gate and up already rounded to the model
    dtype, with the reference's roundings (silu(gate) and the product); h in that dtype. fused_moe's
    pointer GEMMs share it."""
    dt = g.dtype
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit(do_not_specialize=["num_pid_m"])
def _gate_up_kernel(xs_desc, X, wg_desc, wu_desc, h_desc, SORTED, BLOCK_EXPERT, BLOCK_ROWS,
                    D, I, top_k, num_pid_m, limit, stride_xm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    HAS_LIMIT: tl.constexpr, A_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_m, pid_n, e = _block_tile(BLOCK_EXPERT, num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if e < 0:
        return
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    w_row = e * I + n0
    dt = h_desc.dtype
    if not A_TMA:  # x rows gathered through pointers (no xs)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
        pair = tl.load(SORTED + row0 + offs_m, mask=row_ok, other=0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = X + (pair // top_k)[:, None] * stride_xm + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, D, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        if A_TMA:
            a = xs_desc.load([row0, k0])
        else:
            a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & (offs_k < D - k0)[None, :], other=0.0)
        bg = wg_desc.load([w_row, k0])
        bu = wu_desc.load([w_row, k0])
        acc_g = tl.dot(a, bg.T, acc_g)
        acc_u = tl.dot(a, bu.T, acc_u)
    h_desc.store([row0, n0], swiglu_clamped(acc_g.to(dt), acc_u.to(dt), limit, HAS_LIMIT))


@triton.jit(do_not_specialize=["num_pid_m"])
def _down_kernel(h_desc, wd_desc, RW, Y, SORTED, BLOCK_EXPERT, BLOCK_ROWS, D, I, num_pid_m, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_m, pid_n, e = _block_tile(BLOCK_EXPERT, num_pid_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if e < 0:
        return
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    w_row = e * D + n0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        a = h_desc.load([row0, k0])
        b = wd_desc.load([w_row, k0])
        acc = tl.dot(a, b.T, acc)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < tl.load(BLOCK_ROWS + pid_m)
    pair = tl.load(SORTED + row0 + offs_m, mask=row_ok, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    dt = Y.dtype.element_ty
    w = tl.load(RW + pair, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * w[:, None]
    tl.store(Y + pair[:, None] * stride_ym + offs_n[None, :], y.to(dt), mask=row_ok[:, None] & (offs_n < D)[None, :])


# Configs whose kernels failed to compile on a device (key: device, config): refused from then on.
_REFUSED: dict[tuple, str] = {}


def refusals() -> dict[tuple, str]:
    """(device, config) -> the compile error, for each config launch_or_refuse refused."""
    return dict(_REFUSED)


def launch_or_refuse(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                     rw: torch.Tensor, y: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                     block_rows: torch.Tensor, top_k: int, limit: float | None, cfg: dict) -> bool:
    """grouped_gemms(...), or False (with a warning, once) where this config's kernels do not
    compile on x's device (e.g. warp specialisation or a tile's shared memory): the caller then
    runs its pointer GEMMs. Triton compiles at the first launch, before anything runs on the GPU."""
    key = (str(x.device), repr(cfg))
    if key in _REFUSED:
        return False
    try:
        grouped_gemms(x, w_gate, w_up, w_down, rw, y, sorted_ids, block_expert, block_rows, top_k, limit, cfg)
        return True
    except (triton.CompilationError, triton.runtime.errors.OutOfResources) as err:
        _REFUSED[key] = f"{type(err).__name__}: {str(err)[:300]}"
        warnings.warn(f"fused_moe_tma: config {cfg} does not compile on {x.device} ({_REFUSED[key]}); "
                      "the MoE runs on fused_moe's pointer GEMMs", RuntimeWarning, stacklevel=3)
        return False


def _desc(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def grouped_gemms(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  rw: torch.Tensor, y: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                  block_rows: torch.Tensor, top_k: int, limit: float | None, cfg: dict) -> None:
    """fused_moe's steps 2-3 on TMA tiles: y[pair] = w[pair] · down_e(SwiGLU(gate_e, up_e)(x[tok])) for
    every real row of the aligned blocks (cfg: CONFIG's layout; BLOCK_M the alignment's)."""
    _, d = x.shape
    e, i, _ = w_gate.shape
    nb = block_expert.shape[0]
    bm = cfg["BLOCK_M"]
    gu, dn = cfg["gate_up"], cfg["down"]
    a_tma = bool(cfg.get("A_TMA", True))
    launch = pdl.launch(x.device)
    rows = nb * bm
    h = torch.empty(rows, i, dtype=x.dtype, device=x.device)
    if a_tma:
        xs = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        block_d = min(256, triton.next_power_of_2(d))
        _gather_kernel[(nb, triton.cdiv(d, block_d))](x, xs, sorted_ids, block_expert, block_rows, d, top_k, nb,
                                                      x.stride(0), xs.stride(0), BLOCK_M=bm, BLOCK_D=block_d,
                                                      **launch, num_warps=4)
        xs_desc = _desc(xs, [bm, gu["BLOCK_K"]])
    else:
        xs_desc = _desc(x, [bm, gu["BLOCK_K"]])  # unused (A_TMA=False): any descriptor of the right type
    wg_desc = _desc(w_gate.view(e * i, d), [gu["BLOCK_N"], gu["BLOCK_K"]])
    wu_desc = _desc(w_up.view(e * i, d), [gu["BLOCK_N"], gu["BLOCK_K"]])
    h_desc = _desc(h, [bm, gu["BLOCK_N"]])
    _gate_up_kernel[(nb * triton.cdiv(i, gu["BLOCK_N"]),)](
        xs_desc, x, wg_desc, wu_desc, h_desc, sorted_ids, block_expert, block_rows,
        d, i, top_k, nb, float(limit) if limit is not None else 0.0, x.stride(0),
        BLOCK_M=bm, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], GROUP_M=gu["GROUP_M"],
        HAS_LIMIT=limit is not None, A_TMA=a_tma, WARP_SPECIALIZE=bool(gu.get("WARP_SPECIALIZE", False)),
        **launch, num_warps=gu["num_warps"], num_stages=gu["num_stages"])
    hd_desc = _desc(h, [bm, dn["BLOCK_K"]])
    wd_desc = _desc(w_down.view(e * d, i), [dn["BLOCK_N"], dn["BLOCK_K"]])
    _down_kernel[(nb * triton.cdiv(d, dn["BLOCK_N"]),)](
        hd_desc, wd_desc, rw, y, sorted_ids, block_expert, block_rows, d, i, nb, y.stride(0),
        BLOCK_M=bm, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], GROUP_M=dn["GROUP_M"],
        WARP_SPECIALIZE=bool(dn.get("WARP_SPECIALIZE", False)),
        **launch, num_warps=dn["num_warps"], num_stages=dn["num_stages"])
