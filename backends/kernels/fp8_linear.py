"""Dense fp8 linear (ReferenceOps.linear with `scale_inv`) as a Triton kernel, w8a16 or w8a8, and
the same kernel for a few rows of 16-bit weights (`skinny_linear`, SCALED=False: decode GEMVs).

w8a8 (`act_fp8`, CudaH200Ops' default): x is quantised to e4m3 per row and K scale block
(act_quant.act_tile_e4m3; inside the GEMM up to INKERNEL_QUANT_MAX_ROWS rows, else once by
`act_quant` for weights of PREQUANT_MIN_WEIGHT bytes and more), the product is e4m3 x e4m3 on the
tensor cores, and s_x·s_w scales each K tile's fp32 partial. The rest of this docstring is w8a16:

    y [N, out] = x [N, in] · dequant(W)ᵀ (+ bias),   dequant(W)[o, i] = fp8[o, i] · scale_inv[o // bo, i // bi]

W is fp8 (e4m3, or e5m2) with DeepSeek block scales `scale_inv [ceil(out/bo), ceil(in/bi)]`
(bo, bi powers of two >= 16, normally 128x128). The reference dequantises the whole matrix to
the activation dtype on every call (a full extra write + read of 2·out·in bytes); here each
[BLOCK_K, BLOCK_N] weight tile is dequantised in registers exactly as dequantize_block_fp8 does
(fp8 -> fp32, times its block's scale, rounded to the activation dtype), the products accumulate
in fp32 (tensor cores for bf16/fp16, IEEE fp32 for fp32 activations), and the result (+ bias,
rounded to x.dtype first as the reference does) is rounded once. Every weight byte is read once
per BLOCK_M rows of x: once in all for decode (N <= BLOCK_M).

Decode (N = 1..256) is memory bound: the grid is the (M-tile, out-tile) pairs in grouped order
(the M tiles of one weight tile are neighbours, so a second M tile hits L2). When that gives
fewer programs than SMs (e.g. 4096 -> 512, N = 1: 8 tiles for 132 SMs), K is split as well
(split-K): each split writes an fp32 partial to a [S, N, out] workspace and a second small
launch sums the splits in order (deterministic, no atomics), adds the bias and rounds. The
split count is capped so that the workspace traffic stays under the weight bytes.

Prefill (N up to 16K) uses 128x128 tensor-core tiles; the dequantisation is repeated once per
M tile (cheap next to the MMA).

No host sync: the split count and grid come from shapes only and the SM count (cached), so the
op can be captured in a CUDA graph.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .act_quant import act_fp8_supported, act_quant, act_tile_e4m3  # noqa: F401 (act_quant re-exported)
from .fused_moe import ACT_DTYPES, FP8_DTYPES
from . import pdl
from .pdl import pdl_enter
from .interpreter import patch_interpreter
from .tile_loads import load_k_tile

patch_interpreter()

# Tiles by token count N (first row with N <= max_tokens wins). BLOCK_N / BLOCK_K are capped at
# the scale block (one scale per weight tile).
CONFIGS: list[tuple[int, dict]] = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (1 << 62, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)),
]
# w8a8 (act_fp8) up to 16 rows: the weight rows on the MMA's M side (SWAP_AB, as the fused MoE's
# decode tiles), the few tokens on its N side. `bench.fp8_linear_h200 --act dynamic --tokens 1,16
# --sweep --sweep-tiles ...` on an H200, 2026-12-03, µs at 1 row (this tile / the table's 16x64):
# KDA in_proj 32.3 / 43.4, dsa o 24.1 / 30.1, kda o 13.9 / 17.3, dsa q_b 11.1 / 12.0; 16 rows alike
A8_DECODE_MAX_ROWS = 16
A8_DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, SWAP_AB=True)
# w8a8 (act_fp8) past the table's 256-row entry: `bench.fp8_linear_h200 --act dynamic --sweep
# --sweep-tokens 16384` on an H200, 2026-11-30 (ms, this tile / the 16-bit table's 128x128x64 with
# 8 warps): kda q,k,v 1.65 / 1.98, kda o 1.64 / 1.77, dsa o 3.30 / 3.56, dsa q_b 1.43 / 1.45
A8_PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
# fp32 activations are the parity path (FMA dots on the GPU): small tiles (dequant at K 64 spills).
FP32_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)

# w8a8 (act_fp8): up to this many rows each program quantises its x tile itself (no extra launch);
# above, one act_quant launch first, since every out tile would redo the whole x: N/BLOCK_N
# quantised elements per weight byte (at 64 rows the in-kernel quantisation made the step's fp8
# linears 1.5x slower than w8a16 on the H200). Weights under PREQUANT_MIN_WEIGHT bytes keep the
# in-kernel route at any N: there the extra launch costs more than the redundant work.
INKERNEL_QUANT_MAX_ROWS = 16
PREQUANT_MIN_WEIGHT = 4 << 20

# w8a8 from this many rows (a multiple of 4, cuBLASLt's rule): cuBLASLt's block-scaled fp8 GEMM
# (torch._scaled_mm with 1x128 activation and 128x128 weight scales; CUDA >= 12.9 on SM90) on
# act_quant's output, where this torch has it (probed once per device, else the Triton GEMM).
# At prefill sizes the Triton w8a8 GEMM ran at 620-690 TFLOP/s on the H200, below bf16 cuBLAS.
CUBLAS_MIN_ROWS = 1024
_CUBLAS_OK: dict = {}  # device index -> whether torch._scaled_mm took the block-scaled problem

SPLIT_MIN_WAVES = 2.0   # split K while the tiles fill fewer than SMs: aim for this many programs per SM
SPLIT_WS_RATIO = 1.0    # workspace bytes (fp32 partials, written + read) at most this x the weight bytes
REDUCE_BLOCK = 1024

_SM_COUNT: dict = {}


def get_config(n_tokens: int, act_dtype: torch.dtype = torch.bfloat16, act_fp8: bool = False) -> dict:
    """The tile table's entry for N tokens (a fresh copy; callers may edit it)."""
    if act_dtype == torch.float32:
        return dict(FP32_CONFIG)
    if act_fp8 and n_tokens <= A8_DECODE_MAX_ROWS:
        return dict(A8_DECODE_CONFIG)
    lim, cfg = next((lim, c) for lim, c in CONFIGS if n_tokens <= lim)
    return dict(A8_PREFILL_CONFIG if act_fp8 and lim == CONFIGS[-1][0] else cfg)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pretend to be an H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def split_k(n_tokens: int, out_f: int, in_f: int, cfg: dict, sms: int) -> tuple[int, int]:
    """(splits, K elements per split, a multiple of BLOCK_K) for this problem and tile."""
    bk = cfg["BLOCK_K"]
    kb = triton.cdiv(in_f, bk)
    tiles = triton.cdiv(n_tokens, cfg["BLOCK_M"]) * triton.cdiv(out_f, cfg["BLOCK_N"])
    s = 1
    if tiles < sms and kb > 1:
        want = triton.cdiv(int(SPLIT_MIN_WAVES * sms), tiles)
        cap = max(1, int(SPLIT_WS_RATIO * in_f) // (8 * n_tokens))  # S·N·out·8 <= ratio·out·in
        s = max(1, min(kb, want, cap))
    return split_layout(in_f, bk, s)


@triton.jit
def dequant_tile(w, scale, DT: tl.constexpr):
    """fp8 (or any) weight tile -> activation dtype, as dequantize_block_fp8 rounds it."""
    return (w.to(tl.float32) * scale).to(DT)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    X, W, S, B, Y, WS, XS,
    M, N_OUT, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_xsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr = True,
    ACT_FP8: tl.constexpr = False, X_FP8: tl.constexpr = False, SWAP_AB: tl.constexpr = False,
    PDL: tl.constexpr = False):
    # X_FP8 (with ACT_FP8): x is already e4m3 (act_quant's output), its scales XS [M, K / SCALE_BK]
    # SWAP_AB (with ACT_FP8): accᵀ [BN, BM] = W_tile [BN, BK] · xᵀ [BK, BM], the weight rows on the
    # MMA's M side and the few tokens on its N side, as the fused MoE's decode tiles (FP8A8_CONFIGS)
    pdl_enter(PDL)
    # grouped launch order: GROUP_M consecutive M tiles sweep the out tiles together (L2 reuse)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(N_OUT, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    dt = X.dtype.element_ty

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = offs_m < M
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_OUT
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    offs_k = tl.arange(0, BLOCK_K)

    if SWAP_AB:
        a_ptrs = X + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]                # [BK, BM]
        b_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]   # [BN, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_ptrs = X + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        b_ptrs = W + offs_n.to(tl.int64)[None, :] * stride_wn + (k_lo + offs_k)[:, None]   # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s_ptr = S + (n0 // SCALE_BN) * stride_sn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SWAP_AB:
            a = load_k_tile(a_ptrs, row_ok, K - k0, offs_k, 0, EVEN_K)
            b = load_k_tile(b_ptrs, n_ok, K - k0, offs_k, 1, EVEN_K)
            sc = tl.load(s_ptr + (k0 // SCALE_BK) * stride_sk).to(tl.float32)
            aq, sa = act_tile_e4m3(a, XS, offs_m, row_ok, stride_xsm, k0 // SCALE_BK, 0, X_FP8)
            acc += tl.dot(b, aq) * (sa * sc)
        else:
            a = load_k_tile(a_ptrs, row_ok, K - k0, offs_k, 1, EVEN_K)
            b = load_k_tile(b_ptrs, n_ok, K - k0, offs_k, 0, EVEN_K)
            if ACT_FP8:  # w8a8: x per row over this K tile (= its scale block), here or by act_quant
                sc = tl.load(s_ptr + (k0 // SCALE_BK) * stride_sk).to(tl.float32)
                aq, sa = act_tile_e4m3(a, XS, offs_m, row_ok, stride_xsm, k0 // SCALE_BK, 1, X_FP8)
                acc += tl.dot(aq, b) * (sa * sc)
            else:
                if SCALED:
                    sc = tl.load(s_ptr + (k0 // SCALE_BK) * stride_sk).to(tl.float32)
                    b = dequant_tile(b, sc, dt)
                acc = tl.dot(a.to(dt), b.to(dt), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)

    ok = row_ok[:, None] & n_ok[None, :]
    if SPLIT:  # fp32 partial of this K range; _reduce_kernel sums the splits
        ws = WS + (pid_k * M + offs_m)[:, None] * N_OUT + offs_n[None, :]
        tl.store(ws, acc, mask=ok)
    else:
        if HAS_BIAS:
            bias = tl.load(B + offs_n, mask=n_ok, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
            acc += bias[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(WS, B, Y, M, N_OUT, SPLITS, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs_n < N_OUT
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(WS + (s * M + row) * N_OUT + offs_n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=ok, other=0.0).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------
def supported(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None,
              block: tuple[int, int] = (128, 128), bias: torch.Tensor | None = None) -> bool:
    """Whether fp8_linear takes these arguments (x [..., in]); else use the reference."""
    if scale_inv is None or w.dim() != 2 or w.dtype not in FP8_DTYPES or w.stride(-1) != 1:
        return False
    if x.dim() < 1 or x.dtype not in ACT_DTYPES or x.shape[-1] != w.shape[1]:
        return False
    if len(block) != 2:
        return False
    bo, bi = int(block[0]), int(block[1])
    if bo < 16 or bi < 16 or bo & (bo - 1) or bi & (bi - 1):
        return False
    out_f, in_f = w.shape
    if tuple(scale_inv.shape) != (triton.cdiv(out_f, bo), triton.cdiv(in_f, bi)) or not scale_inv.is_floating_point():
        return False
    tensors = [x, w, scale_inv]
    if bias is not None:
        if tuple(bias.shape) != (out_f,) or not bias.is_floating_point():
            return False
        tensors.append(bias)
    return all(t.device == x.device for t in tensors)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: dict | None = None, splits: int | None = None, act_fp8: bool = False) -> torch.Tensor:
    """ReferenceOps.linear(x, w, bias, scale_inv, block) for x [N, in], fp8 w [out, in] -> [N, out].

    `out` [N, out] (x.dtype, unit last stride) is written in place when given; `config` overrides
    the tile table entry; `splits` forces the split-K count (1: none). `act_fp8`: w8a8 as in
    fused_moe (x quantised per row and K scale block on the fly, fp8 x fp8 products; the
    reference is ReferenceOps.linear with fp8_activations="dynamic"), where act_fp8_supported."""
    n, in_f = x.shape
    out_f = w.shape[0]
    if out is None:
        out = torch.empty(n, out_f, dtype=x.dtype, device=x.device)
    assert out.shape == (n, out_f) and out.dtype == x.dtype and out.stride(-1) == 1
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    act_fp8 = act_fp8_supported(act_fp8, x.dtype, w.dtype, block)
    cfg = get_config(n, x.dtype, act_fp8)
    if config:
        cfg.update(config)
    bo, bi = int(block[0]), int(block[1])
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], bo)  # one scale per weight tile
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], bi)
    if act_fp8:
        cfg["BLOCK_K"] = bi  # one K tile = one activation group = the weight's scale block
    if splits is None:
        s, k_split = split_k(n, out_f, in_f, cfg, sm_count(x.device))
    else:
        s, k_split = split_layout(in_f, cfg["BLOCK_K"], splits)
    if act_fp8 and n > INKERNEL_QUANT_MAX_ROWS and out_f * in_f >= PREQUANT_MIN_WEIGHT:  # x once, not per out tile
        xq, xs = act_quant(x, bi)
        if config is None and splits is None and _cublas_blockwise(xq, xs, w, scale_inv, (bo, bi), bias, out):
            return out
        return _run(xq, w, scale_inv, (bo, bi), bias, out, cfg, s, k_split, True, xs)
    return _run(x, w, scale_inv, (bo, bi), bias, out, cfg, s, k_split, act_fp8)


def _cublas_blockwise(xq, xs, w, scale_inv, block, bias, out) -> bool:
    """out = (xq·xs)(w·scale_inv)ᵀ + bias through torch._scaled_mm (cuBLASLt), when the problem is
    one it takes: CUDA, N >= CUBLAS_MIN_ROWS and a multiple of 4, 128x128 weight blocks, K a
    multiple of 128, a contiguous out. False leaves out untouched (the caller runs Triton)."""
    n, in_f = xq.shape
    key = xq.device.index if xq.is_cuda else None
    if (key is None or _CUBLAS_OK.get(key) is False or n < CUBLAS_MIN_ROWS or n % 4 or tuple(block) != (128, 128)
            or in_f % 128 or w.dtype != torch.float8_e4m3fn or not out.is_contiguous()
            or tuple(scale_inv.shape) != (triton.cdiv(w.shape[0], 128), in_f // 128)):
        return False
    try:
        torch._scaled_mm(xq, w.t(), xs.t().contiguous().t(), scale_inv.float().contiguous().t(), bias=bias,
                         out_dtype=out.dtype, out=out)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:  # this torch / CUDA lacks it
        _CUBLAS_OK[key] = False
        warnings.warn(f"fp8_linear: torch._scaled_mm without 1x128/128x128 block scales here ({err}); "
                      "the Triton w8a8 GEMM runs instead", RuntimeWarning, stacklevel=3)
        return False
    _CUBLAS_OK[key] = True
    return True


def split_layout(in_f: int, bk: int, splits: int) -> tuple[int, int]:
    """(splits, K elements per split, a multiple of bk) closest to `splits` (at most one per K tile)."""
    kb = triton.cdiv(in_f, bk)
    per = triton.cdiv(kb, max(1, min(int(splits), kb)))
    return triton.cdiv(kb, per), per * bk


def _run(x, w, scale_inv, block, bias, out, cfg, s, k_split, act_fp8: bool = False,
         x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of the kernel (+ the split-K reduce when s > 1); scale_inv None = 16-bit w;
    x_scales given: x is e4m3 from act_quant."""
    n, in_f = x.shape
    out_f = w.shape[0]
    bk = cfg["BLOCK_K"]
    scaled = scale_inv is not None
    sc = scale_inv if scaled else w  # unused when SCALED=False
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is moot for 16-bit operands
    ws = torch.empty(s, n, out_f, dtype=torch.float32, device=x.device) if s > 1 else out
    b = bias if bias is not None else sc  # unused when HAS_BIAS=False
    grid = (triton.cdiv(n, cfg["BLOCK_M"]) * triton.cdiv(out_f, cfg["BLOCK_N"]), s)
    launch = pdl.launch(x.device)
    xs = x_scales if x_scales is not None else sc  # unused unless X_FP8
    _fp8_linear_kernel[grid](
        x, w, sc, b, out, ws, xs,
        n, out_f, in_f, k_split,
        x.stride(0), w.stride(0), sc.stride(0) if scaled else 0, sc.stride(1) if scaled else 0, out.stride(0),
        xs.stride(0) if x_scales is not None else 0,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        SCALE_BN=block[0], SCALE_BK=block[1], HAS_BIAS=bias is not None, SPLIT=s > 1,
        EVEN_K=in_f % bk == 0, PRECISION=precision, SCALED=scaled, ACT_FP8=act_fp8, X_FP8=x_scales is not None,
        SWAP_AB=act_fp8 and bool(cfg.get("SWAP_AB", False)),
        **launch, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if s > 1:
        blk = min(REDUCE_BLOCK, triton.next_power_of_2(out_f))
        _reduce_kernel[(n, triton.cdiv(out_f, blk))](ws, b, out, n, out_f, s, out.stride(0),
                                                    HAS_BIAS=bias is not None, BLOCK=blk, **launch, num_warps=4)
    return out

# ---------------------------------------------------------------------------------------
# 16-bit weights at decode sizes (the same kernel, SCALED=False)
# ---------------------------------------------------------------------------------------
# A decode step of a few rows streams each weight once: the kernel is bound by how many bytes
# each SM keeps in flight, not by the math. cuBLAS's batch-1 GEMVs on the H200 ran at 50-80%
# of the copy rate on the step's mid-size projections (16-134 MB) and split K with a second
# reduce launch (bench.decode_profile's kernel table). Here the out tile is as wide as still gives
# every SM two programs, and the K tile is widened in step so that one weight tile is ~16 KB
# whatever its width (4 stages: ~64 KB in flight per program). K is split (plus the reduce
# launch) only when even 16-wide out tiles leave half the SMs idle.
SKINNY_MAX_ROWS = 8
SKINNY_TILE_BYTES = 16384
SKINNY_SPLIT_BELOW = 0.5   # split K when the out tiles fill fewer than this x the SMs
# Out widths that leave only 16/32-wide tiles for every SM twice (2K-8K outputs) over K >= 4096
# stream better as 64-wide tiles with K split in 4 (one reduce launch more): `bench.decode_ops
# --only linear` on the H200, one row, µs in a PDL graph chain against the tile above: the KDA
# o_proj (4096 x 8192) 20.1 vs 24.0, the MLA q_a+kv_a (2048 x 4096) 8.2 vs 11.0, the MLA o_proj
# (4096 x 16384) 35.2 vs 43.7 (cuBLAS 22.1 / 9.8 / 36.2). Shorter K (the indexer's and MLA's
# 1536-wide q_b) stays with cuBLAS.
SKINNY_LONG_K = 4096
SKINNY_LONG_K_SPLITS = 4


def skinny_supported(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether skinny_linear takes x [..., in] · w [out, in]ᵀ: 16-bit x and w of one dtype, a few rows."""
    if x.dim() < 1 or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if w.dim() != 2 or w.stride(-1) != 1 or x.shape[-1] != w.shape[1] or w.shape[1] < 16:
        return False
    if x.numel() // max(1, x.shape[-1]) > SKINNY_MAX_ROWS or w.device != x.device:
        return False
    return bias is None or (tuple(bias.shape) == (w.shape[0],) and bias.device == x.device)


def skinny_preferred(n_tokens: int, out_f: int, in_f: int, sms: int) -> bool:
    """Whether the skinny kernel beat cuBLAS at this shape class on the H200 (bench.skinny_linear,
    1 and 4 rows; bench/RESULTS.md): the 64-wide out tiles (the KDA in_proj: 1.11-1.15x), the
    split-K shapes (out <= ~1K: 1.4x, one launch fewer) and short K (<= 256: 1.03-1.05x). cuBLAS
    stays ahead on the LM head (0.93x) and on 16/32-wide tiles over long K (0.83-0.94x)."""
    cfg, s, _ = skinny_config(n_tokens, out_f, in_f, sms)
    return s > 1 or cfg["BLOCK_N"] == 64 or in_f <= 256


def skinny_config(n_tokens: int, out_f: int, in_f: int, sms: int) -> tuple[dict, int, int]:
    """(tile, splits, K elements per split) for a few rows of x against a 16-bit [out_f, in_f] weight."""
    bn = next((b for b in (128, 64, 32) if triton.cdiv(out_f, b) >= 2 * sms), 16)
    bk = max(16, min(triton.next_power_of_2(in_f), SKINNY_TILE_BYTES // (2 * bn), 512))
    cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=4, num_stages=4)
    kb = triton.cdiv(in_f, bk)
    tiles = triton.cdiv(out_f, bn)
    s = 1
    if tiles < SKINNY_SPLIT_BELOW * sms and kb > 1:
        s = min(kb, triton.cdiv(sms, tiles))
    elif bn < 64 and triton.cdiv(out_f, 64) <= sms and in_f >= SKINNY_LONG_K:
        # a long K behind a few thousand outputs: 64-wide tiles, K in SKINNY_LONG_K_SPLITS
        bn, bk, s = 64, SKINNY_TILE_BYTES // 128, SKINNY_LONG_K_SPLITS
        cfg.update(BLOCK_N=bn, BLOCK_K=bk)
    return (cfg, *split_layout(in_f, bk, s))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: dict | None = None, splits: int | None = None) -> torch.Tensor:
    """ReferenceOps.linear(x, w, bias) for a few rows of 16-bit x [N, in] and w [out, in] -> [N, out].

    fp32 accumulation, one rounding (+ bias rounded to x.dtype first, as the reference adds it).
    `config` overrides the tile; `splits` forces the split-K count (1: none)."""
    n, in_f = x.shape
    out_f = w.shape[0]
    out = torch.empty(n, out_f, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg, s, k_split = skinny_config(n, out_f, in_f, sm_count(x.device))
    if config:
        cfg.update(config)
    if config or splits is not None:
        s, k_split = split_layout(in_f, cfg["BLOCK_K"], splits or s)
    return _run(x, w, None, (cfg["BLOCK_N"], cfg["BLOCK_K"]), bias, out, cfg, s, k_split)
