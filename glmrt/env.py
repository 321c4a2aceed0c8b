"""The environment variables glmrt reads, each through one typed accessor."""

from __future__ import annotations

import os

KV_TRANSFERS = ("auto", "nixl", "zmq")


def kv_checksum() -> bool:
    """GLMRT_KV_CHECKSUM=1: crc32 every handoff's state on both ends (opt-in: on GPUs it costs a
    device-to-host copy of the bytes moved)."""
    return os.environ.get("GLMRT_KV_CHECKSUM", "0") == "1"


def kv_transfer() -> str:
    """GLMRT_KV_TRANSFER=auto|nixl|zmq: how prefill hands state to decode (auto: NIXL where it
    works, else the zmq fallback). Any other value is refused."""
    value = os.environ.get("GLMRT_KV_TRANSFER", "auto")
    if value not in KV_TRANSFERS:
        raise ValueError(f"GLMRT_KV_TRANSFER={value!r}: expected one of {', '.join(KV_TRANSFERS)}")
    return value
