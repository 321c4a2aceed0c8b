"""The w8a8 prefill GEMMs of the fused MoE on Hopper, written in Gluon (Triton's layout-explicit
dialect) so that each K block's fp8 product runs while the previous one is scaled.

fp8 weights carry a scale per 128x128 block and w8a8 activations one per row and 128 columns
(DeepSeek's block scales), so the product of each 128-wide K block is an fp32 partial that has to
be scaled before it is added: acc += (x_q · w_qᵀ) · s_x[row] · s_w. Triton's kernels
(fused_moe_kernels.py) write that as `acc += dot(x, w) * s`; the compiler waits for each wgmma
group before the multiply (`wgmma.wait_group 0` after every product of gate/up), so the tensor
cores idle through every scaling and the next block's issue.

Here the products are asynchronous and one block behind: block i's wgmma groups (gate and up, or
down) are issued, then block i-1's are retired (`wait(num_outstanding=groups)`) and scaled into
the accumulators while block i runs. The activation rows are gathered by cp.async (the sorted
pair list names them), the weight tiles come by TMA, both into a STAGES-deep ring.

Same inputs, same numerics and rounding points as the Triton kernels on their X_FP8 path (x and h
quantised once by act_quant): the fp32 partial of each K block times s_w·s_x, gate and up rounded
to the model dtype before the clamped SwiGLU, the down product rounded before the routing weight.
Gluon has no interpreter: the kernels are compiled for sm_90 in CI
(tests/backends/test_fused_moe_sm90.py) and compared with the Triton kernels on the GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64   # rows of a block: one warpgroup's M (the alignment's block, moe_align)
BLOCK_K = 128  # one activation group and one weight scale block along K
# per GEMM: BLOCK_N output columns (per projection for gate/up), the ring's depth, the warps (4:
# one warpgroup; 8: two side by side along N), GROUP_M blocks that sweep their N tiles together
CONFIG = dict(gate_up=dict(BLOCK_N=64, STAGES=4, num_warps=4, GROUP_M=8),
              down=dict(BLOCK_N=128, STAGES=4, num_warps=4, GROUP_M=8))


@gluon.jit
def _issue_step(j, a_ring, w_ring0, w_ring1, bars, a_ptrs, W0, W1, w_row, GATE_UP: gl.constexpr,
                MERGED: gl.constexpr, WG: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                B_TMA: gl.constexpr):
    """K block j into ring stage j % STAGES: the weight tiles by TMA (the stage's barrier counts
    their bytes), the gathered activation rows by cp.async (one commit group). MERGED: gate and
    up in one tile, each warpgroup's column chunk of gate rows followed by the same chunk of up."""
    s = j % STAGES
    k0 = j * BLOCK_K
    if not B_TMA:  # W0 / W1: the weight tiles' pointers, copied with the rows
        async_copy.async_copy_global_to_shared(w_ring0.index(s), W0 + k0)
        if GATE_UP:
            async_copy.async_copy_global_to_shared(w_ring1.index(s), W1 + k0)
    elif MERGED:
        CW: gl.constexpr = W0.block_type.shape[0]
        mbarrier.expect(bars.index(s), 2 * WG * W0.block_type.nbytes)
        for w in gl.static_range(WG):
            tma.async_copy_global_to_shared(W0, [w_row + w * CW, k0], bars.index(s),
                                            w_ring0.index(s).slice(2 * w * CW, CW))
            tma.async_copy_global_to_shared(W1, [w_row + w * CW, k0], bars.index(s),
                                            w_ring0.index(s).slice((2 * w + 1) * CW, CW))
    elif GATE_UP:
        mbarrier.expect(bars.index(s), W0.block_type.nbytes + W1.block_type.nbytes)
        tma.async_copy_global_to_shared(W0, [w_row, k0], bars.index(s), w_ring0.index(s))
        tma.async_copy_global_to_shared(W1, [w_row, k0], bars.index(s), w_ring1.index(s))
    else:
        mbarrier.expect(bars.index(s), W0.block_type.nbytes)
        tma.async_copy_global_to_shared(W0, [w_row, k0], bars.index(s), w_ring0.index(s))
    async_copy.async_copy_global_to_shared(a_ring.index(s), a_ptrs + k0)


@gluon.jit
def _scales(i, xs_row, s0_tile, s1_tile, stride_s0k, stride_s1k, GATE_UP: gl.constexpr):
    """K block i's scale per row, s_x · s_w, for W0's (and W1's) product (the tile lies in one
    weight scale block)."""
    sx = gl.load(xs_row + i)
    f0 = sx * gl.load(s0_tile + i * stride_s0k)
    if GATE_UP:
        f1 = sx * gl.load(s1_tile + i * stride_s1k)
    else:
        f1 = f0
    return f0, f1


@gluon.jit
def _refill(j, nk, a_ring, w_ring0, w_ring1, bars, a_ptrs, W0, W1, w_row, GATE_UP: gl.constexpr,
            MERGED: gl.constexpr, WG: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
            B_TMA: gl.constexpr):
    """Issue K block j (nothing past the last) as one cp.async commit group."""
    if j < nk:
        _issue_step(j, a_ring, w_ring0, w_ring1, bars, a_ptrs, W0, W1, w_row, GATE_UP, MERGED, WG, BLOCK_K,
                    STAGES, B_TMA)
    async_copy.commit_group()


@gluon.jit
def _arrive(i, bars, YOUNGER: gl.constexpr, STAGES: gl.constexpr, B_TMA: gl.constexpr):
    """Wait until K block i's tiles have landed (YOUNGER copy groups were committed after its
    own); returns its stage."""
    s = i % STAGES
    async_copy.wait_group(YOUNGER)  # this thread's rows of block i
    if B_TMA:
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)  # the weight tiles
    fence_async_shared()
    gl.thread_barrier()  # ... and every thread's rows
    return s


@gluon.jit
def _products(s, a_ring, w_ring0, w_ring1, zero, keep1, GATE_UP: gl.constexpr, MERGED: gl.constexpr):
    """The fp8 products of the block in stage s, issued asynchronously into fresh accumulators
    (W1's only for gate/up unmerged; else keep1 is passed through)."""
    a = a_ring.index(s)
    q0 = warpgroup_mma(a, w_ring0.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    if GATE_UP and not MERGED:
        q1 = warpgroup_mma(a, w_ring1.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        q1 = keep1
    return q0, q1


@gluon.jit
def _split_gate_up(r, BLOCK_N: gl.constexpr, WG: gl.constexpr):
    """A merged gate/up product [M, 2·BLOCK_N] (per warpgroup w: its gate chunk, then its up
    chunk) as gate [M, BLOCK_N] and up [M, BLOCK_N]. A thread holds column c and c + chunk of a
    warpgroup's product, so this only relabels registers."""
    CW: gl.constexpr = BLOCK_N // WG
    r4 = gl.reshape(r, [r.shape[0], WG, 2, CW])
    r3 = gl.reshape(gl.permute(r4, [0, 1, 3, 2]), [r.shape[0], BLOCK_N, 2])
    return gl.split(r3)


@gluon.jit
def _retire(acc0, acc1, p0, p1, f0, f1, GATE_UP: gl.constexpr, MERGED: gl.constexpr, PENDING: gl.constexpr,
            BLOCK_N: gl.constexpr, WG: gl.constexpr):
    """Wait for a set of products (leaving PENDING sets in flight) and add them, scaled."""
    if MERGED:
        r = warpgroup_mma_wait(num_outstanding=PENDING, deps=(p0, ))
        r0, r1 = _split_gate_up(r, BLOCK_N, WG)
        acc1 += r1 * f1[:, None]
    elif GATE_UP:
        r0, r1 = warpgroup_mma_wait(num_outstanding=2 * PENDING, deps=(p0, p1))
        acc1 += r1 * f1[:, None]
    else:
        r0 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(p0, ))
    acc0 += r0 * f0[:, None]
    return acc0, acc1


@gluon.jit
def _moe_gemm_sm90_kernel(X, XS, W0, W1, S0, S1, OUT, RW, SORTED, BLOCK_EXPERT, BLOCK_ROWS,
                          n_out, K, top_k, num_pid_m, limit,
                          stride_x, stride_xs, stride_s0e, stride_s0n, stride_s0k,
                          stride_s1e, stride_s1n, stride_s1k, stride_out,
                          GATE_UP: gl.constexpr, MERGED: gl.constexpr, B_TMA: gl.constexpr, O_SMEM: gl.constexpr,
                          HAS_LIMIT: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALE_BN: gl.constexpr,
                          num_warps: gl.constexpr):
    """One (block, N tile) of either GEMM. GATE_UP: X = e4m3 tokens [N, D] (row = pair // top_k),
    W0 / W1 = gate / up [E·I, D], OUT = h [pairs, I] = SwiGLU(gate, up). Else X = e4m3 h
    [pairs, I] (top_k 1), W0 = down [E·D, I], OUT = y [pairs, D] = product · routing weight.
    XS: X's scales [rows, K / 128]; S0 / S1: the weights' block scales [E, out / 128, K / 128]."""
    pid = gl.program_id(0)
    # grouped launch order: GROUP_M consecutive blocks sweep the N tiles together (L2 reuse of
    # the weight tiles by an expert's blocks)
    in_group = GROUP_M * gl.cdiv(n_out, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    e = gl.load(BLOCK_EXPERT + pid_m)
    if e < 0:  # past the blocks the alignment filled
        return
    n0 = pid_n * BLOCK_N
    nrows = gl.load(BLOCK_ROWS + pid_m)

    WG: gl.constexpr = num_warps // 4
    # the accumulators [BLOCK_M, BLOCK_N]: the warpgroups side by side along N
    ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                    instr_shape=[16, BLOCK_N // WG, 32])
    # the activation copies: 16 bytes a thread, 8 threads across a 128-byte row
    LD: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    # the output stores: 16 bytes (8 values) a thread, whole rows
    ST: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    o_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    a_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_sl)
    # the weight tiles' layout: TMA's (NVMMA, 128-byte swizzle for 128 fp8 columns), also for cp.async
    w_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    if MERGED:
        w_ring0 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 2 * BLOCK_N, BLOCK_K], w_sl)
    else:
        w_ring0 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_sl)
    if GATE_UP and not MERGED:
        w_ring1 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_sl)
    else:
        w_ring1 = w_ring0
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], o_sl)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)

    # the block's rows: pairs from the sorted list (rows past nrows are never written there:
    # they read token 0 and are not stored)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
    pair = gl.load(SORTED + pid_m * BLOCK_M + offs_m, mask=offs_m < nrows, other=0).to(gl.int64)
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LD))
    a_ptrs = X + (pair // top_k)[:, None] * stride_x + offs_k[None, :]
    if MERGED:  # one product of gate and up chunks side by side, split into the two accumulators
        PROD_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                         instr_shape=[16, 2 * BLOCK_N // WG, 32])
        zero = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, layout=PROD_L)
        acc0, acc1 = _split_gate_up(zero, BLOCK_N, WG)
    else:
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=ACC_L)
        acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=ACC_L)
        acc1 = acc0
    keep = warpgroup_mma_init(zero)
    ROW_L: gl.constexpr = gl.SliceLayout(1, acc0.type.layout)
    offs_ma = gl.arange(0, BLOCK_M, layout=ROW_L)
    pair_a = gl.load(SORTED + pid_m * BLOCK_M + offs_ma, mask=offs_ma < nrows, other=0).to(gl.int64)
    xs_row = XS + (pair_a // top_k) * stride_xs
    w_row = e * n_out + n0
    if B_TMA:
        B0 = W0
        B1 = W1
    else:  # W0 / W1 are the stacked weights [E·out, K]: this tile's rows
        offs_bn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
        b_rows = (w_row + offs_bn).to(gl.int64)[:, None] * K + offs_k[None, :]
        B0 = W0 + b_rows
        B1 = W1 + b_rows
    s0_tile = S0 + e * stride_s0e + (n0 // SCALE_BN) * stride_s0n
    s1_tile = S1 + e * stride_s1e + (n0 // SCALE_BN) * stride_s1n

    nk = K // BLOCK_K
    for j in gl.static_range(STAGES - 2):
        _refill(j, nk, a_ring, w_ring0, w_ring1, bars, a_ptrs, B0, B1, w_row, GATE_UP, MERGED, WG, BLOCK_K, STAGES, B_TMA)

    # two K blocks a step, A (even) and B (odd): both issued, then A retired and scaled while B
    # runs, then B. Nothing is left in flight across the loop's back edge: ptxas serialises every
    # wgmma of a kernel that reads a loop-carried accumulator while another wgmma is in flight.
    for i in range(0, nk, 2):
        gl.thread_barrier()  # every warp has retired blocks i-2 and i-1: their stages may be refilled
        _refill(i + STAGES - 2, nk, a_ring, w_ring0, w_ring1, bars, a_ptrs, B0, B1, w_row, GATE_UP, MERGED, WG,
                BLOCK_K, STAGES, B_TMA)
        _refill(i + STAGES - 1, nk, a_ring, w_ring0, w_ring1, bars, a_ptrs, B0, B1, w_row, GATE_UP, MERGED, WG,
                BLOCK_K, STAGES, B_TMA)
        fa0, fa1 = _scales(i, xs_row, s0_tile, s1_tile, stride_s0k, stride_s1k, GATE_UP)
        fb0, fb1 = _scales(i + 1, xs_row, s0_tile, s1_tile, stride_s0k, stride_s1k, GATE_UP)
        s = _arrive(i, bars, STAGES - 1, STAGES, B_TMA)
        pa0, pa1 = _products(s, a_ring, w_ring0, w_ring1, zero, keep, GATE_UP, MERGED)
        s = _arrive(i + 1, bars, STAGES - 2, STAGES, B_TMA)
        pb0, pb1 = _products(s, a_ring, w_ring0, w_ring1, zero, keep, GATE_UP, MERGED)
        acc0, acc1 = _retire(acc0, acc1, pa0, pa1, fa0, fa1, GATE_UP, MERGED, 1, BLOCK_N, WG)
        acc0, acc1 = _retire(acc0, acc1, pb0, pb1, fb0, fb1, GATE_UP, MERGED, 0, BLOCK_N, WG)
    async_copy.wait_group(0)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))

    dt: gl.constexpr = gl.bfloat16
    if GATE_UP:
        # the reference's roundings: gate and up, silu(gate) and the product, each in the model dtype
        g = acc0.to(dt).to(gl.float32)
        u = acc1.to(dt).to(gl.float32)
        if HAS_LIMIT:
            g = gl.minimum(g, limit)
            u = gl.minimum(gl.maximum(u, -limit), limit)
        sg = (g / (1.0 + gl.exp(-g))).to(dt).to(gl.float32)
        out = (sg * u).to(dt)
    else:
        w = gl.load(RW + pair_a, mask=offs_ma < nrows, other=0.0).to(gl.float32)
        out = (acc0.to(dt).to(gl.float32) * w[:, None]).to(dt)
    if O_SMEM:
        # through shared memory, then 16-byte stores of row pieces (the accumulator's layout
        # stores 4 bytes at a time)
        o_smem.store(out)
        gl.thread_barrier()
        offs_ms = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ST))
        pair_s = gl.load(SORTED + pid_m * BLOCK_M + offs_ms, mask=offs_ms < nrows, other=0).to(gl.int64)
        offs_ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ST))
        gl.store(OUT + pair_s[:, None] * stride_out + offs_ns[None, :], o_smem.load(ST),
                 mask=(offs_ms < nrows)[:, None])
    else:
        offs_no = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out.type.layout))
        gl.store(OUT + pair_a[:, None] * stride_out + offs_no[None, :], out, mask=(offs_ma < nrows)[:, None])


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------
def _aligned_16b(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0
                                                                 for st in t.stride()[:-1])


def supported(x: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor, block: tuple[int, int],
              config: dict | None = None) -> bool:
    """Whether these GEMMs take a w8a8 MoE call: a Hopper GPU (not ROCm), bf16 activations, e4m3
    weights with 128x128 block scales, contiguous 16-byte aligned weights, output widths the N
    tiles divide, and an even count of K blocks at least a ring deep."""
    if not (x.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(x.device)[0] == 9):
        return False
    if x.dtype != torch.bfloat16 or w_gate.dtype != torch.float8_e4m3fn or w_down.dtype != torch.float8_e4m3fn:
        return False
    if tuple(int(b) for b in block) != (128, 128):
        return False
    e, i, d = w_gate.shape
    cfg = config or CONFIG
    for w, n_out, k, part in ((w_gate, i, d, "gate_up"), (w_down, d, i, "down")):
        c = cfg[part]
        if not (w.is_contiguous() and w.data_ptr() % 16 == 0) or n_out % c["BLOCK_N"] or k % BLOCK_K:
            return False
        # one weight scale per tile and K block: the tile inside one 128-wide scale block
        # K blocks two a step, at least a ring deep
        if k // BLOCK_K < c["STAGES"] or (k // BLOCK_K) % 2 or c["STAGES"] < 3:
            return False
        wg = c["num_warps"] // 4
        if c["BLOCK_N"] > 128 or c["BLOCK_N"] % (8 * wg) or (c.get("merged") and 2 * c["BLOCK_N"] // wg > 256):
            return False
        if c.get("merged") and not c.get("b_tma", True):  # the merged tile is laid out by TMA
            return False
    return True


def _weight_desc(w: torch.Tensor, block_n: int) -> TensorDescriptor:
    """A TMA descriptor over the stacked weights [E, out, K] as rows [E·out, K], tiles [block_n, 128]."""
    e, n, k = w.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.float8e4nv)
    return TensorDescriptor(w.view(e * n, k), [e * n, k], [k, 1], [block_n, BLOCK_K], layout)


def _launch(gate_up: bool, xq, xs, ws, scales, out, rw, sorted_ids, block_expert, block_rows, n_out, k, top_k,
            limit, c: dict) -> None:
    nb = block_expert.shape[0]
    bn = c["BLOCK_N"]
    merged = gate_up and c.get("merged", False)
    b_tma = c.get("b_tma", True)  # the weight tiles by TMA, else by cp.async with the rows
    descs = [_weight_desc(w, bn // (c["num_warps"] // 4) if merged else bn) if b_tma else w for w in ws]
    s0 = scales[0]
    s1 = scales[1] if gate_up else scales[0]
    grid = (nb * triton.cdiv(n_out, bn),)
    _moe_gemm_sm90_kernel[grid](
        xq, xs, descs[0], descs[-1], s0, s1, out, rw, sorted_ids, block_expert, block_rows,
        n_out, k, top_k, nb, float(limit) if limit is not None else 0.0,
        xq.stride(0), xs.stride(0), *s0.stride(), *s1.stride(), out.stride(0),
        GATE_UP=gate_up, MERGED=merged, B_TMA=b_tma, O_SMEM=c.get("o_smem", True), HAS_LIMIT=limit is not None, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K,
        GROUP_M=c["GROUP_M"], STAGES=c["STAGES"], SCALE_BN=128, num_warps=c["num_warps"])


def gate_up(xq: torch.Tensor, xs: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            scales: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, sorted_ids: torch.Tensor,
            block_expert: torch.Tensor, block_rows: torch.Tensor, top_k: int, limit: float | None,
            config: dict | None = None) -> None:
    """h[pair] = SwiGLU(gate_e x, up_e x) for every aligned pair (x e4m3 [N, D] with scales xs)."""
    e, i, d = w_gate.shape
    _launch(True, xq, xs, (w_gate, w_up), scales, h, h, sorted_ids, block_expert, block_rows, i, d, top_k,
            limit, (config or CONFIG)["gate_up"])


def down(hq: torch.Tensor, hs: torch.Tensor, w_down: torch.Tensor, scale: torch.Tensor, rw: torch.Tensor,
         y: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, block_rows: torch.Tensor,
         config: dict | None = None) -> None:
    """y[pair] = (down_e h[pair]) · rw[pair] for every aligned pair (h e4m3 [pairs, I] with scales hs)."""
    e, d, i = w_down.shape
    _launch(False, hq, hs, (w_down,), (scale,), y, rw, sorted_ids, block_expert, block_rows, d, i, 1, None,
            (config or CONFIG)["down"])
