"""Side work (backends/side_work.py): a layer's independent chains of small launches on a second
CUDA stream at decode sizes.

Which forks get a stream (CPU): the reference and CPU tensors never, cuda-h200 up to
SIDE_STREAM_MAX_TOKENS rows. On the GPU: the side stream starts where the current stream stood
and the current stream waits for it at join (a slow producer before the fork, a reader after the
join); and the tiny model's logits through prefill, eager decode and decode CUDA graphs are bit
for bit those of one stream.
"""

from __future__ import annotations

import pytest
import torch

from backends.reference import ReferenceOps
from backends.side_work import INLINE, Inline, SideStream

triton = pytest.importorskip("triton")

from tests.backends.decode_steps import decode_logits  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_inline_runs_in_place():
    from backends.cuda_h200 import CudaH200Ops

    x = torch.zeros(1, 8)
    assert ReferenceOps().fork(x) is INLINE
    assert CudaH200Ops().fork(x) is INLINE  # CPU tensors
    out = []
    with INLINE:
        out.append(1)
    INLINE.join()
    assert out == [1]


@pytest.mark.gpu
@needs_cuda
def test_cuda_forks_by_rows(monkeypatch):
    from backends.cuda_h200 import CudaH200Ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ops = CudaH200Ops()
    one = torch.zeros(1, 8, device="cuda")
    side = ops.fork(one)
    assert isinstance(side, SideStream) and ops.fork(one) is side  # one stream per device, reused
    assert type(ops.fork(torch.zeros(ops.SIDE_STREAM_MAX_TOKENS + 1, 8, device="cuda"))) is Inline
    monkeypatch.setattr(CudaH200Ops, "SIDE_STREAM_MAX_TOKENS", 0)
    assert type(ops.fork(one)) is Inline


@pytest.mark.gpu
@needs_cuda
def test_side_stream_orders_against_the_current_stream():
    """The side work reads what the current stream wrote before the fork (a long matmul chain
    that is still running when the block opens), and the current stream reads the side work's
    result only after join."""
    side = SideStream(torch.cuda.Stream())
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        b = torch.rand(1, device="cuda")
        x = a
        for _ in range(8):  # ~ms of queued work before the fork
            x = (x @ a) / 2048
        x.add_(b)
        with side:
            assert torch.cuda.current_stream() == side.stream
            y = x * 2
        assert torch.cuda.current_stream() != side.stream
        side.join()
        z = y + 1
        torch.cuda.synchronize()
        assert torch.equal(z, x * 2 + 1)


@pytest.mark.gpu
@needs_cuda
def test_side_streams_decode_bit_identical(monkeypatch):
    """Each fork's side work starts behind a ~1 ms sleep on the side stream, so a join missing
    before its results are read would read them unwritten (in eager steps and in the graphs)."""
    from backends.cuda_h200 import CudaH200Ops

    forks = []
    enter = SideStream.__enter__

    def slow_enter(self):
        enter(self)
        forks.append(1)
        torch.cuda._sleep(1_000_000)
        return self
    monkeypatch.setattr(SideStream, "__enter__", slow_enter)
    for rows in (3, 1):
        monkeypatch.setattr(CudaH200Ops, "SIDE_STREAM_MAX_TOKENS", 16)  # every decode step forks
        forks.clear()
        forked = decode_logits(rows)
        assert len(forks) >= 3 * 4  # (tiny: 3 KDA layers with two forks, DSA ones with one) x steps
        monkeypatch.setattr(CudaH200Ops, "SIDE_STREAM_MAX_TOKENS", 0)
        forks.clear()
        one = decode_logits(rows)
        assert not forks
        assert torch.isfinite(one).all()
        assert torch.equal(forked, one), rows
