"""The cuda-h200 KDA path against ReferenceOps: our conv kernels and fla-core's KDA kernels.

Without CUDA everything runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is
set before Triton is imported): the conv kernels and fla's fused_recurrent as they are, fla's
chunk_kda after `enable_interpreted_chunk()` (interpreter fixes: tensor loop variables, no
autotune timing, bf16 arithmetic). With CUDA the same tests run compiled ("cuda"). The fla
tests skip when fla-core is not installed. Every check draws fresh random inputs, poisons
outputs with NaN, fills the slots of new requests (prefix_len 0) with NaN (they must be
ignored), and checks that slots outside the batch keep every bit. Bounds as for every kernel
(tests/backends/conftest.py): fp32 1e-5, bf16 1e-2 relative to an fp32 evaluation.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from backends.kernels.conv import causal_conv  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
from tests.backends.conftest import tol as _tol  # noqa: E402

_HAVE_FLA = importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not _HAVE_FLA, reason="needs fla-core (pip install fla-core==0.6.0 einops)")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element, or a stale slot was read)"
    return float((out - ref).norm() / ref.norm())


def _batch(prefix, seqs, device, seed, spare=3):
    """BatchMeta with shuffled slots (some unused), plus the slot ids of new / untouched requests."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(len(seqs) + spare, generator=g)[: len(seqs)].tolist()
    meta = BatchMeta.build(prefix, seqs, slots, [[0]] * len(seqs), 1 << 20, device)
    new = [s for s, p in zip(slots, prefix) if p == 0]
    return meta, len(seqs) + spare, new, g


# ---- conv ---------------------------------------------------------------------------------------
CONV_CASES = {
    # prefix lens, new tokens: long runs, runs shorter than K-1 over history, an empty request,
    # new requests with short and long runs, all in one batch
    "mixed": ([0, 9, 4, 2, 0, 6], [13, 1, 2, 0, 2, 21]),
    "decode": ([5, 0, 1, 8], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("k", [4, 3])
def test_conv_kernel(device, case, dtype, state_dtype, k):
    prefix, seqs = CONV_CASES[case]
    c = 40  # two channel blocks of 32 with a ragged tail
    seed = 17 * k + 3 * len(case) + (dtype == torch.bfloat16) + 5 * (state_dtype == torch.bfloat16)
    meta, slots, new, g = _batch(prefix, seqs, device, seed=seed)
    n = sum(seqs)
    x = torch.randn(n, c, generator=g).to(dtype)
    w = torch.randn(c, k, generator=g)
    state = torch.randn(slots, k - 1, c, generator=g).to(state_dtype)
    state[new] = float("nan")
    ref_state = state.clone()
    ref_state[new] = 0.0  # the reference ignores them too; zeros keep its arithmetic NaN-free
    ref = ReferenceOps().causal_conv(x.float(), ref_state, w, meta)
    modes = [None, False] if case == "decode" else [None]
    for mode in modes:  # decode batches: the fused kernel, then the general two-kernel path
        st = state.clone().to(device)
        out = torch.full((n, c), float("nan"), dtype=dtype, device=device)
        res = causal_conv(x.to(device), st, w.to(device), meta, out=out, decode=mode, block_t=4, block_c=32)
        assert res is out
        assert _rel(out, ref) < _tol(dtype)
        for s in range(slots):
            if s in meta.slot_ids.tolist():
                assert torch.equal(st[s].cpu().float(), ref_state[s].to(state_dtype).float()), f"slot {s}"
            else:
                assert torch.equal(st[s].cpu(), state[s]), f"slot {s} outside the batch was written"


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_kernel_planes(device, case):
    """planes=3 (the KDA layer's q, k, v): the output is [3, N, C/3], each plane contiguous and
    equal to its column group of the one-plane output; channel blocks of 32 straddle the planes'
    16-column edges."""
    prefix, seqs = CONV_CASES[case]
    c, k = 48, 4
    meta, slots, new, g = _batch(prefix, seqs, device, seed=29 + len(case))
    n = sum(seqs)
    x = torch.randn(n, c, generator=g).to(torch.bfloat16)
    w = torch.randn(c, k, generator=g)
    state = torch.randn(slots, k - 1, c, generator=g).to(torch.bfloat16)
    state[new] = 0.0
    ref_state = state.clone()
    ref = ReferenceOps().causal_conv(x.float(), ref_state, w, meta, planes=3)
    assert ref.shape == (3, n, c // 3) and ref.is_contiguous()
    for mode in ([None, False] if case == "decode" else [None]):
        st = state.clone().to(device)
        one = causal_conv(x.to(device), st.clone(), w.to(device), meta, decode=mode, block_t=4, block_c=32)
        res = causal_conv(x.to(device), st, w.to(device), meta, decode=mode, block_t=4, block_c=32, planes=3)
        assert res.shape == (3, n, c // 3) and res.is_contiguous()
        assert _rel(res, ref) < _tol(torch.bfloat16)
        for p, part in enumerate(one.chunk(3, dim=-1)):
            assert torch.equal(res[p], part)
        for s in meta.slot_ids.tolist():
            assert torch.equal(st[s].cpu().float(), ref_state[s].float()), f"slot {s}"


@pytest.mark.parametrize("num_warps", [4, 8])
def test_conv_kernel_prefill_tile(device, num_warps):
    """The prefill kernel on the GPU's tile (16 tokens x 256 channels; 4 warps, the default, and 8)
    over three planes of 256 channels, two requests, one with history: so the suite's compile check
    builds the tile the GPU launches."""
    prefix, seqs = [5, 0], [21, 19]
    c, k = 768, 4
    meta, slots, new, g = _batch(prefix, seqs, device, seed=31)
    n = sum(seqs)
    x = torch.randn(n, c, generator=g).to(torch.bfloat16)
    w = torch.randn(c, k, generator=g).to(torch.bfloat16)
    state = torch.randn(slots, k - 1, c, generator=g).to(torch.bfloat16)
    state[new] = 0.0
    ref_state = state.clone()
    ref = ReferenceOps().causal_conv(x.float(), ref_state, w.float(), meta, planes=3)
    st = state.to(device)
    res = causal_conv(x.to(device), st, w.to(device), meta, decode=False, planes=3, num_warps=num_warps)
    assert _rel(res, ref) < _tol(torch.bfloat16)
    for s in meta.slot_ids.tolist():
        assert torch.equal(st[s].cpu().float(), ref_state[s].float()), f"slot {s}"


def test_conv_via_ops_uses_device_lengths(device):
    """CudaH200Ops.causal_conv on a decode batch whose Python prefix_lens are placeholders (as in
    a captured CUDA graph): only the device tensors may be read."""
    from backends.cuda_h200 import CudaH200Ops

    prefix, seqs = [3, 0, 7], [1, 1, 1]
    meta, slots, new, g = _batch(prefix, seqs, device, seed=5)
    x = torch.randn(3, 24, generator=g)
    w = torch.randn(24, 4, generator=g)
    state = torch.randn(slots, 3, 24, generator=g)
    ref_state = state.clone()
    ref = ReferenceOps().causal_conv(x, ref_state, w, meta)
    meta.prefix_lens = [999] * 3
    st = state.to(device)
    out = CudaH200Ops().causal_conv(x.to(device), st, w.to(device), meta)
    assert _rel(out, ref) < 1e-5
    assert torch.equal(st.cpu(), ref_state)


# ---- KDA through fla ----------------------------------------------------------------------------
def _kda_inputs(n, h, dk, dv, dtype, g):
    q = torch.randn(n, h, dk, generator=g).to(dtype)
    k = torch.randn(n, h, dk, generator=g).to(dtype)
    v = torch.randn(n, h, dv, generator=g).to(dtype)
    # the model's bounded gate: lb * sigmoid(.) with lb = -5, so values anywhere in (-5, 0)
    gate = -5.0 * torch.sigmoid(2 * torch.randn(n, h, dk, generator=g))
    beta = torch.sigmoid(torch.randn(n, h, generator=g)).to(dtype)
    return q, k, v, gate, beta


def _kda_check(device, prefix, seqs, dtype, state_dtype, seed, h=2, dk=16, dv=32, run=None, fp32_tol=1e-5):
    meta, slots, new, g = _batch(prefix, seqs, device, seed)
    n = sum(seqs)
    q, k, v, gate, beta = _kda_inputs(n, h, dk, dv, dtype, g)
    state = (0.3 * torch.randn(slots, h, dk, dv, generator=g)).to(state_dtype)
    state[new] = float("nan")
    truth_state = state.float().clone()
    truth_state[new] = 0.0
    # fp32 truth on the same (rounded) inputs and the same starting state
    ref = ReferenceOps().kda(q.float(), k.float(), v.float(), gate, beta.float(), truth_state, meta)
    st = state.to(device)
    args = [t.to(device) for t in (q, k, v, gate, beta)]
    out = run(*args, st, meta)
    assert out.dtype == v.dtype and out.shape == v.shape
    tol = fp32_tol if dtype == torch.float32 else _tol(dtype)
    assert _rel(out, ref) < tol
    batch_slots = [s for s, n_ in zip(meta.slot_ids.tolist(), seqs) if n_ > 0]
    tol = fp32_tol if dtype == state_dtype == torch.float32 else _tol(torch.bfloat16)
    for s in range(slots):
        if s in batch_slots:
            assert _rel(st[s], truth_state[s]) < tol, f"slot {s}"
        else:  # outside the batch, or a request with no new token: every bit kept
            assert torch.equal(torch.nan_to_num(st[s].cpu(), 7.0), torch.nan_to_num(state[s], 7.0)), f"slot {s}"


@needs_fla
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_kda_decode_fused_recurrent(device, dtype, state_dtype):
    """Decode: zero the new requests' slots, then fla's fused_recurrent in place on the slots."""
    from backends.kernels import kda as kk

    def run(q, k, v, gate, beta, st, meta):
        out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
        res = kk.kda_decode(q, k, v, gate, beta, st, meta.slot_ids, meta.prefix_lens_t, meta.cu_seqlens_t, out=out)
        assert res is out
        return out

    _kda_check(device, [4, 0, 1, 9, 0], [1] * 5, dtype, state_dtype, seed=11, run=run)


@needs_fla
@pytest.mark.parametrize("launch", [dict(BV=16, num_warps=2), dict(BV=64, num_warps=8, num_stages=1),
                                    dict(BV=128, num_warps=4)])
def test_kda_decode_launch_shapes(device, launch, monkeypatch):
    """The decode tile is a launch choice (kda.DECODE_LAUNCHES, swept by bench.kda_h200): every
    shape gives the reference's output and slots, also where BV does not divide dv (48)."""
    from backends.kernels import kda as kk
    monkeypatch.setattr(kk, "DECODE_LAUNCH", dict(dict(BV=32, num_warps=4, num_stages=2), **launch))

    def run(q, k, v, gate, beta, st, meta):
        out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device)
        return kk.kda_decode(q, k, v, gate, beta, st, meta.slot_ids, meta.prefix_lens_t, meta.cu_seqlens_t, out=out)

    _kda_check(device, [4, 0, 1, 9], [1] * 4, torch.float32, torch.float32, seed=13, run=run, dv=48)


@needs_fla
def test_kda_decode_via_ops_uses_device_lengths(device):
    from backends.cuda_h200 import CudaH200Ops

    def run(q, k, v, gate, beta, st, meta):
        meta.prefix_lens = [999] * meta.num_reqs  # graph placeholders: must not be read
        return CudaH200Ops().kda(q, k, v, gate, beta, st, meta)

    _kda_check(device, [2, 0, 6], [1, 1, 1], torch.float32, torch.float32, seed=12, run=run)


@needs_fla
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_kda_short_rows_in_place(device, dtype, state_dtype):
    """Every request 1..RECURRENT_MAX_TOKENS new tokens (a verify or rollback of speculative
    decoding, over history or new): fused_recurrent in place over each request's run, through
    CudaH200Ops with device lengths only (meta.prefix_lens are placeholders), no chunk_kda."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import kda as kk

    def run(q, k, v, gate, beta, st, meta):
        assert kk.short_rows(meta)
        meta.prefix_lens = [999] * meta.num_reqs
        return CudaH200Ops().kda(q, k, v, gate, beta, st, meta)

    _kda_check(device, [4, 0, 1, 9, 0, 3], [6, 3, 1, kk.RECURRENT_MAX_TOKENS, 2, 4], dtype, state_dtype, seed=15,
               run=run)


@pytest.fixture
def interpreted_chunk(device):
    """Interpreted prefill through chunk_kda for this test only: later CPU tests of whole models
    keep the (much faster) reference prefill."""
    from backends.kernels import kda as kk
    if device.type == "cpu":
        kk.enable_interpreted_chunk()
    yield
    kk.INTERPRET_CHUNK = False


# One chunk_kda call costs seconds in the interpreter: few cases, small heads. gate_floor -5.0
# (the inputs' gates are in (-5, 0), as the model's) takes chunk_kda's safe-gate path, None the
# general one.
@needs_fla
@pytest.mark.parametrize("split_decode,gate_floor", [(True, None), (True, -5.0), (False, -5.0)])
def test_kda_mixed_batch(device, interpreted_chunk, split_decode, gate_floor):
    """A prefill chunk of 70 tokens (two chunks of 64) over history, a new request, an empty one and
    decode rows (one new): fused_recurrent on the single-token rows, chunk_kda with gathered and
    scattered states on the rest; or (split_decode=False) everything through chunk_kda."""
    from backends.kernels import kda as kk
    assert kk.safe_gate(gate_floor) == (gate_floor is not None)

    def run(q, k, v, gate, beta, st, meta):
        return kk.kda(q, k, v, gate, beta, st, meta, split_decode=split_decode, gate_floor=gate_floor)

    # compiled, fla's fp32 tl.dot runs in tf32 (10-bit mantissa): a tf32-level bound there
    _kda_check(device, [0, 5, 3, 7, 0], [9, 1, 0, 70, 1], torch.float32, torch.float32, seed=13, h=1, run=run,
               fp32_tol=5e-3 if device.type == "cuda" else 1e-5)


@needs_fla
@pytest.mark.parametrize("gate_floor", [None, -5.0])
def test_kda_prefill_bf16_via_ops(device, interpreted_chunk, gate_floor):
    """bf16 inputs and state, prefill only (one request over history, one new), through CudaH200Ops."""
    from backends.cuda_h200 import CudaH200Ops

    def run(q, k, v, gate, beta, st, meta):
        return CudaH200Ops().kda(q, k, v, gate, beta, st, meta, gate_floor=gate_floor)

    _kda_check(device, [4, 0], [20, 3], torch.bfloat16, torch.bfloat16, seed=14, h=1, run=run)


@needs_fla
@pytest.mark.parametrize("case,lb,in_recurrence,zero_first", [
    ("prefill", -5.0, True, False), ("mixed", -5.0, True, False), ("short", -5.0, True, False),
    ("decode", -5.0, True, False), ("decode", None, True, False), ("decode", -5.0, False, False),
    ("prefill", -5.0, True, True), ("mixed", -5.0, True, True), ("short", -5.0, True, True),
    ("decode", -5.0, True, True), ("decode", -5.0, False, True)])
def test_kda_gated(device, interpreted_chunk, case, lb, in_recurrence, zero_first, monkeypatch):
    """ops.kda_gated: on a prefill batch (every request more than one token, one over history, one
    new) chunk_kda computes the bounded gate from the projection's output in its cumsum kernel; a
    batch of short rows or decode rows has fla's recurrent kernel compute it (with and without a
    lower bound), or, with kda.DECODE_GATE_IN_KERNEL off, and in a batch with a decode row and a
    long prefill, kda_gate runs first, then kda. Each against the fp32 reference, and the gate
    kernel is launched only where the gate is not computed inside. `zero_first`: the layer's
    ops.zero_fresh_slots ran first (beside the conv, in the model): it zeroes the new requests'
    slots where the recurrence reads them in place, and they are zeroed once."""
    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import kda as kk
    from backends.kernels import kda_gate as kg

    monkeypatch.setattr(kk, "DECODE_GATE_IN_KERNEL", in_recurrence)
    gate_launches, gate_kernel = [], kg.kda_gate
    monkeypatch.setattr(kg, "kda_gate", lambda *a: gate_launches.append(1) or gate_kernel(*a))
    zero_launches, zero_kernel = [], kk.zero_new_slots
    monkeypatch.setattr(kk, "zero_new_slots", lambda *a: zero_launches.append(1) or zero_kernel(*a))
    # "short": every request at most RECURRENT_MAX_TOKENS new tokens, kda's in-place recurrent path
    prefix, seqs = {"prefill": ([4, 0], [20, 3]), "mixed": ([4, 0, 9], [20, 3, 1]), "short": ([4, 0], [5, 3]),
                    "decode": ([4, 0, 9], [1, 1, 1])}[case]
    h, dk, dv = 2, 16, 32
    meta, slots, new, g = _batch(prefix, seqs, device, seed=31 + len(seqs))
    n = sum(seqs)
    q, k, v, _, beta = _kda_inputs(n, h, dk, dv, torch.bfloat16, g)
    f = torch.randn(n, h * dk, generator=g).to(torch.bfloat16)
    dt_bias, a_log = 0.5 * torch.randn(h * dk, generator=g), 0.5 * torch.randn(h, generator=g)
    state = 0.3 * torch.randn(slots, h, dk, dv, generator=g)
    state[new] = float("nan")
    truth_state = state.clone()
    truth_state[new] = 0.0
    ref = ReferenceOps().kda_gated(q.float(), k.float(), v.float(), f.float(), dt_bias, a_log, lb, beta.float(),
                                   truth_state, meta)
    args = [t.to(device) for t in (q, k, v, f, dt_bias, a_log)]
    st = state.to(device)
    assert kk.gate_in_kernel(*args, lb, beta.to(device), st, meta) == (case == "prefill")
    inside = kk.gate_in_recurrence(*args, beta.to(device), st, meta)
    assert inside == (in_recurrence and case in ("short", "decode"))
    ops = CudaH200Ops()
    zeroed = ops.zero_fresh_slots(st, meta) if zero_first else False
    in_place = case in ("short", "decode")
    assert zeroed == (zero_first and in_place)
    if zeroed:
        assert all(float(st[s].abs().sum()) == 0.0 for s in new)
    out = ops.kda_gated(*args, lb, beta.to(device), st, meta, slots_zeroed=zeroed)
    assert len(gate_launches) == (0 if inside or case == "prefill" else 1)
    assert len(zero_launches) == (0 if case == "prefill" else 1)
    assert out.dtype == v.dtype and _rel(out, ref) < _tol(torch.bfloat16)
    for s in {int(x) for x in meta.slot_ids.tolist()}:
        assert _rel(st[s], truth_state[s]) < _tol(torch.bfloat16), f"slot {s}"


# ---- real head sizes, GPU only (fla specializes its kernels on dk/dv) -------------------------------
@needs_fla
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_floor", [None, -5.0])
def test_kda_real_head_dims_gpu(state_dtype, gate_floor):
    from backends.cuda_h200 import CudaH200Ops

    def run(q, k, v, gate, beta, st, meta):
        return CudaH200Ops().kda(q, k, v, gate, beta, st, meta, gate_floor=gate_floor)

    dev = torch.device("cuda")
    _kda_check(dev, [0, 300, 7, 12], [200, 1, 1, 129], torch.bfloat16, state_dtype, seed=21, h=4, dk=128, dv=128,
               run=run)
    _kda_check(dev, [0, 300, 7, 12], [1, 1, 1, 1], torch.bfloat16, state_dtype, seed=22, h=4, dk=128, dv=128, run=run)


# ---- the forget gate -----------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("n,h,d,dtype", [(1, 64, 128, torch.bfloat16), (9, 4, 16, torch.float32), (33, 3, 20, torch.bfloat16)])
def test_kda_gate_matches_reference(device, lower_bound, n, h, d, dtype):
    from backends.kernels.kda_gate import kda_gate, supported
    from tests.backends.conftest import rel

    g = torch.Generator().manual_seed(n * 1000 + h + (0 if lower_bound is None else 1))
    f = (torch.randn(n, h * d, generator=g) * 8).to(dtype)   # both sides of the softplus threshold
    dt_bias = torch.randn(h * d, generator=g)
    a_log = torch.randn(h, generator=g) * 0.5
    ref = ReferenceOps().kda_gate(f, dt_bias, a_log, lower_bound, h)
    f, dt_bias, a_log = f.to(device), dt_bias.to(device), a_log.to(device)
    assert supported(f, dt_bias, a_log, h)
    got = kda_gate(f, dt_bias, a_log, lower_bound, h)
    assert got.shape == (n, h, d) and got.dtype == torch.float32
    assert rel(got, ref) < 1e-6
    assert bool((got < 0).all()) or lower_bound is None  # a decay
