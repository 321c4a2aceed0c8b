"""The transfer engines' wire structs (peer info, tensor descriptions) and their error type.

`PeerInfo` is what one engine tells another out of band so the other can write into its
registered tensors; it is msgpack-encoded, never pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch


class TransferError(RuntimeError):
    """A programming error: bad regions, unknown tensor or peer, closed engine, ..."""


class TensorDesc(msgspec.Struct, array_like=True, frozen=True):
    """What a peer needs to know about one registered tensor (the result of `register`)."""

    tensor_id: str
    num_bytes: int
    dtype: str
    shape: list[int]
    device: str = "cpu"
    addr: int = 0  # NIXL only: base address in the owner's address space
    dev_id: int = 0
    mem_type: str = "DRAM"  # NIXL: "DRAM" | "VRAM"


class PeerInfo(msgspec.Struct, array_like=True):
    """Everything a peer needs to connect to an engine (`peer_info()` encodes it)."""

    backend: str
    name: str
    tensors: list[TensorDesc]
    address: str = ""  # zmq: the ROUTER endpoint receiving writes
    agent_metadata: bytes = b""  # NIXL: get_agent_metadata()
    version: int = 1

    def tensor(self, tensor_id: str) -> TensorDesc:
        for t in self.tensors:
            if t.tensor_id == tensor_id:
                return t
        raise TransferError(f"peer {self.name!r} has no registered tensor {tensor_id!r}")


WIRE_VERSION = 1
_peer_decoder = msgspec.msgpack.Decoder(PeerInfo)


def decode_peer_info(info: bytes | PeerInfo) -> PeerInfo:
    if isinstance(info, PeerInfo):
        return info
    try:
        return _peer_decoder.decode(info)
    except msgspec.DecodeError as e:
        raise TransferError(f"undecodable peer info: {e}") from e


def describe_tensor(tensor_id: str, tensor: torch.Tensor, **extra: Any) -> TensorDesc:
    return TensorDesc(tensor_id=tensor_id, num_bytes=tensor.numel() * tensor.element_size(),
                      dtype=str(tensor.dtype).removeprefix("torch."), shape=[int(s) for s in tensor.shape],
                      device=str(tensor.device), **extra)

