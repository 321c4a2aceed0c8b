"""msgspec codec for protocol messages plus out-of-band tensor frames.

A message on the wire is a list of frames: frame 0 is the msgpack-encoded message, frames
1..N are raw tensor buffers. A `TensorRef(dtype, shape, frame=i)` inside the message names
the i-th *tensor* frame (wire frame i + 1), i.e. `tensors[i]` given to `encode` and
`frames[i]` returned by `decode`.

Decoding is typed: a `Codec` is bound to the union its inbox accepts and turns anything
else (unknown tag, wrong field types, garbage, pickles, oversize frames) into a
`ProtocolError`. There is no pickle fallback anywhere.

Tensors: numpy arrays, buffer-protocol objects and torch tensors are accepted; torch is
detected by duck typing and never imported here at module load. Contiguous CPU tensors are
sent zero-copy (a memoryview over their memory; do not write to them until the send is
done). CUDA tensors are copied to host: GPU-to-GPU moves belong to the KV/state transfer.
"""

from __future__ import annotations

import math
import sys
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from glmrt.protocol import TensorRef

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20  # per frame, like zmq.MAXMSGSIZE
DEFAULT_MAX_FRAMES = 1024

Buffer = bytes | bytearray | memoryview

# dtype name -> itemsize. Only these may appear in a TensorRef (no object dtypes from the wire).
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


class ProtocolError(ValueError):
    """A frame list that is not a valid message of the expected union."""


class Codec:
    """Encoder plus a typed decoder for one inbox union (e.g. `protocol.ENGINE_IN`)."""

    def __init__(self, union_type: Any, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_frames: int = DEFAULT_MAX_FRAMES):
        self.union_type = union_type
        self.types: tuple[type, ...] = typing.get_args(union_type) or (union_type,)
        self.max_message_bytes = max_message_bytes
        self.max_frames = max_frames
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union_type)

    def encode(self, msg: Any, tensors: Sequence[Any] = ()) -> list[Buffer]:
        """Frames for `msg` and its tensors (frame 0 msgpack, then one raw buffer per tensor)."""
        if not isinstance(msg, self.types):
            raise TypeError(f"{type(msg).__name__} is not accepted by this inbox ({self.union_type})")
        frames: list[Buffer] = [self._encoder.encode(msg)]
        frames.extend(as_buffer(t) for t in tensors)
        self._check_sizes(frames)
        return frames

    def decode(self, frames: Sequence[Any]) -> tuple[Any, list[memoryview]]:
        """(message, tensor frames) from received frames (bytes, memoryviews or zmq.Frames)."""
        if not frames:
            raise ProtocolError("empty message")
        bufs = [_frame_buffer(f) for f in frames]
        self._check_sizes(bufs)
        try:
            msg = self._decoder.decode(bufs[0])
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            raise ProtocolError(f"undecodable message: {e}") from e
        return msg, bufs[1:]

    def _check_sizes(self, frames: Sequence[Buffer]) -> None:
        if len(frames) > self.max_frames + 1:
            raise ProtocolError(f"{len(frames) - 1} tensor frames exceed the limit of {self.max_frames}")
        for i, f in enumerate(frames):
            n = f.nbytes if isinstance(f, memoryview) else len(f)
            if n > self.max_message_bytes:
                raise ProtocolError(f"frame {i} has {n} bytes, over max_message_bytes={self.max_message_bytes}")


def describe(tensor: Any, frame: int) -> TensorRef:
    """TensorRef for a numpy array or torch tensor sent as tensor frame `frame`."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _ITEMSIZE:
        raise TypeError(f"dtype {dtype} cannot travel in a tensor frame (known: {sorted(_ITEMSIZE)})")
    return TensorRef(dtype=dtype, shape=[int(s) for s in tensor.shape], frame=frame)


def as_buffer(obj: Any) -> memoryview:
    """A flat byte view of `obj`, without copying when it is contiguous and on the CPU."""
    if isinstance(obj, np.ndarray):
        return _ndarray_bytes(obj)
    if isinstance(obj, (bytes, bytearray)):
        return memoryview(obj)
    if hasattr(obj, "untyped_storage") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        return _torch_bytes(obj)
    if isinstance(obj, memoryview) or not hasattr(obj, "__dlpack__"):
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(f"cannot send {type(obj).__name__} as a tensor frame") from None
        return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
    return _ndarray_bytes(np.from_dlpack(obj))


def _ndarray_bytes(arr: np.ndarray) -> memoryview:
    if arr.dtype.hasobject:
        raise TypeError("object arrays cannot be sent as tensor frames")
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _torch_bytes(t: Any) -> memoryview:
    torch = sys.modules["torch"]  # holding a tensor means torch is imported
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # NOTE: a copy; engine-to-engine GPU moves use the KV/state transfer
    t = t.resolve_conj().resolve_neg().contiguous()
    # A byte view works for every dtype, including bfloat16 and fp8 that numpy lacks; the
    # numpy array keeps the tensor alive as its base for as long as zmq holds the frame.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _frame_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame: a view of the message, no copy
    if buf is None:
        buf = frame if isinstance(frame, memoryview) else memoryview(frame)
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def tensor_from_frame(ref: TensorRef, frame: Any, *, as_torch: bool = False) -> Any:
    """The tensor `ref` describes, viewing `frame`'s memory (no copy).

    Returns a numpy array, or with `as_torch` a torch tensor (via torch.frombuffer). bfloat16
    and fp8 have no numpy dtype and need `as_torch`. The result aliases the frame: it stays
    valid as long as it is referenced, but for inproc links it is the sender's memory too.
    """
    itemsize = _ITEMSIZE.get(ref.dtype)
    if itemsize is None:
        raise ProtocolError(f"unknown tensor dtype {ref.dtype!r}")
    if any(s < 0 for s in ref.shape):
        raise ProtocolError(f"negative dimension in shape {ref.shape}")
    buf = _frame_buffer(frame)
    expected = itemsize * math.prod(ref.shape)
    if buf.nbytes != expected:
        raise ProtocolError(f"frame has {buf.nbytes} bytes, {ref.dtype}{ref.shape} needs {expected}")
    if as_torch:
        import torch

        dtype = getattr(torch, ref.dtype)
        if expected == 0:
            return torch.empty(ref.shape, dtype=dtype)
        if buf.readonly:
            buf = memoryview(bytearray(buf))  # NOTE: torch tensors must be writable; copy
        return torch.frombuffer(buf, dtype=dtype).view(ref.shape)
    try:
        dtype = np.dtype(ref.dtype)
    except TypeError:
        raise TypeError(f"{ref.dtype} has no numpy dtype; use as_torch=True") from None
    return np.frombuffer(buf, dtype=dtype).reshape(ref.shape)
