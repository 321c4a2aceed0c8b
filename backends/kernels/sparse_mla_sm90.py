"""The absorbed sparse-MLA prefill rows on Hopper, written in Gluon (Triton's layout-explicit
dialect) so that the two warpgroups of a program split the work instead of repeating it.

The Triton kernel (sparse_mla.py) takes all 64 heads of a query token in one program of 8 warps.
Triton lays a matmul whose result feeds another matmul out with every warp along M (the layout
flash attention wants at 128 query rows); at 64 heads that puts both warpgroups on the same 64
rows, so each computes the whole score tile Q·Cᵀ and a third of the tensor work is repeated.

Here the layouts are spelled out: the score tile [64 heads, BLOCK_N rows] is split by columns
between the two warpgroups (each scores half of the block's latent rows against all heads), the
row max and sum cross the warpgroups through shared memory, the probabilities go to shared
memory, and the output [64, 512] is split by columns (each warpgroup accumulates 256 of the
latent columns over all the block's rows). The block's latent rows are gathered with cp.async
into a two-stage ring while the previous block is computed.

Same inputs, same math and rounding points as `_sparse_mla_decode_kernel` with one split (q and
P rounded to the cache dtype, fp32 accumulation, exp2 with the scale folded in; a row with no
valid token gets zeros). Gluon has no interpreter: the kernel is compiled for sm_90 in CI
(tests/backends/test_sparse_mla_sm90.py) and compared with the Triton kernel on the GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .sparse_mla import _LOG2E

HEADS = 64  # one warpgroup's M: the query heads of a token, all scored against the same rows
RANK = 512  # kv_lora_rank: the latent width, split 256 / 256 between the warpgroups' outputs
NUM_WARPS = 8


@gluon.jit
def _block_rows(idx_row, n0, n_b, BLOCK_N: gl.constexpr, LD: gl.constexpr):
    """The flat latent rows of one block of the row list (-1 past n_b)."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    return gl.load(idx_row + offs_n, mask=offs_n < n_b, other=-1)


@gluon.jit
def _issue_rows(kv_stage, KV, idx, stride_kv, R: gl.constexpr, LD: gl.constexpr):
    """cp.async one block's latent rows into a ring stage (rows listed -1: zeros)."""
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
    rows = gl.maximum(idx, 0).to(gl.int64)
    ptrs = KV + rows[:, None] * stride_kv + offs_r[None, :]
    async_copy.async_copy_global_to_shared(kv_stage, ptrs, mask=(idx >= 0)[:, None])


@gluon.jit
def _sparse_mla_rows_sm90_kernel(Q, KV, IDX, NTOK, O,
                                 stride_qb, stride_qh, stride_kv, stride_ib, stride_ob, stride_oh,
                                 K, qk_scale,
                                 H: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 num_warps: gl.constexpr):
    b = gl.program_id(0).to(gl.int64)
    WG: gl.constexpr = num_warps // 4
    # 16-byte vectors, one warp across 256 columns of a row: the copy's source is row-contiguous
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    # scores [H, BLOCK_N]: warpgroups side by side along the rows of the block
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BLOCK_N // WG, 16])
    # output [H, R]: warpgroups side by side along the latent columns
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, R // WG if R // WG <= 256 else 256, 16])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, R], gl.bfloat16)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, BLOCK_N], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [H, R], q_sl)
    kv_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, R], kv_sl)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [H, BLOCK_N], p_sl)

    offs_h = gl.arange(0, H, layout=gl.SliceLayout(1, LD))
    offs_h64 = offs_h.to(gl.int64)  # q and out may be head-major views: a head's stride spans every row
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(
        q_smem, Q + b * stride_qb + offs_h64[:, None] * stride_qh + offs_r[None, :])

    n_b = gl.minimum(gl.load(NTOK + b), K)
    idx_row = IDX + b * stride_ib
    num_blocks = gl.cdiv(n_b, BLOCK_N)
    # blocks 0 .. STAGES-2 in flight before the loop, one copy group each (q's copy in the first)
    for j in gl.static_range(STAGES - 1):
        _issue_rows(kv_ring.index(j), KV, _block_rows(idx_row, j * BLOCK_N, n_b, BLOCK_N, LD), stride_kv, R, LD)
        async_copy.commit_group()
    # the row list is read a block ahead of the copies it addresses, so no copy waits on its load
    idx_next = _block_rows(idx_row, (STAGES - 1) * BLOCK_N, n_b, BLOCK_N, LD)

    offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_i = gl.zeros([H], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([H, R], gl.float32, layout=O_L)
    s_zero = gl.zeros([H, BLOCK_N], gl.float32, layout=S_L)
    for i in range(num_blocks):
        # every warpgroup is past block i-1's products: its stage and P may be overwritten
        gl.thread_barrier()
        # this block's columns to score, loaded while the copies are issued and land
        offs = i * BLOCK_N + offs_s
        valid = gl.load(idx_row + offs, mask=offs < n_b, other=-1) >= 0
        ahead = i + STAGES - 1
        idx = idx_next
        idx_next = _block_rows(idx_row, (ahead + 1) * BLOCK_N, n_b, BLOCK_N, LD)
        if ahead < num_blocks:
            _issue_rows(kv_ring.index(ahead % STAGES), KV, idx, stride_kv, R, LD)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)  # this thread's copies of block i (and q) have landed
        fence_async_shared()  # this thread's generic-proxy writes, read by wgmma through the async proxy
        gl.thread_barrier()  # ... and every thread's
        kv = kv_ring.index(i % STAGES)

        s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # heads that saw no row yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # both halves of P are written before either warpgroup reads it

        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    out = (acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]).to(O.dtype.element_ty)
    # through q's buffer, then 16-byte stores of whole rows (the accumulator's layout stores 4 bytes
    # at a time)
    gl.thread_barrier()  # every warpgroup's last product has read q
    q_smem.store(out)
    gl.thread_barrier()
    gl.store(O + b * stride_ob + offs_h64[:, None] * stride_oh + offs_r[None, :], q_smem.load(LD))


BLOCK_N = 64  # latent rows per step: two 64 KB stages beside q's 64 KB
CONFIG = dict(BLOCK_N=BLOCK_N, STAGES=2)  # BLOCK_N 32 with 3 or 4 stages: 1.6x slower on an H100


def _rows_16b(t: torch.Tensor) -> bool:
    """Unit stride in the last dimension, 16-byte aligned start and row strides: cp.async moves
    16-byte vectors, and the kernel is compiled for that alignment."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])


def supported(q_abs: torch.Tensor, flat: torch.Tensor) -> bool:
    """The shapes, dtypes and layouts this kernel is written for, on a Hopper GPU (ROCm devices
    report a major version of 9 too: they are not Hopper). The output must be as aligned as q_abs."""
    return (q_abs.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(q_abs.device)[0] == 9
            and q_abs.dtype == torch.bfloat16 and flat.dtype == torch.bfloat16 and flat.dim() == 2
            and q_abs.shape[1] == HEADS and q_abs.shape[2] == RANK and flat.shape[-1] == RANK
            and _rows_16b(q_abs) and _rows_16b(flat))


def sparse_mla_rows_sm90(q_abs: torch.Tensor, flat: torch.Tensor, token_idx: torch.Tensor, num_tokens: torch.Tensor,
                         scale: float, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """out[b] = the attention of q_abs[b] ([64, 512] bf16) over the latent rows flat[token_idx[b, :n]]
    (n = num_tokens[b]; -1 entries skipped); `flat` the cache as [rows, 512] bf16 rows."""
    b = q_abs.shape[0]
    if b == 0:
        return out
    _sparse_mla_rows_sm90_kernel[(b, )](
        q_abs, flat, token_idx, num_tokens, out,
        q_abs.stride(0), q_abs.stride(1), flat.stride(0), token_idx.stride(0), out.stride(0), out.stride(1),
        token_idx.shape[1], float(scale) * _LOG2E,
        H=HEADS, R=RANK, **{**CONFIG, **(config or {})}, num_warps=NUM_WARPS)
    return out
