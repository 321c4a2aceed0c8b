"""Every environment variable glmrt reads, one typed accessor each. No torch.

Each accessor reads the variable when it is called (a test or a parent process may set it after
import), so nothing here is cached. A variable is read here and nowhere else in glmrt/, actors/
and cli/; the layers that must not import glmrt read their own:

    backends/   GLMRT_HARDWARE (backends.adapters.probe_hardware: force the detected hardware,
                e.g. "sm90", instead of probing it in a child interpreter) and TRITON_INTERPRET
                (backends.kernels.interpreter: run the Triton kernels in Triton's CPU interpreter).
                backends/ imports nothing of glmrt, so those reads stay there.
    transport/  sets a default NIXL_LOG_LEVEL before NIXL loads (transport imports only
                glmrt.protocol).

The supervisor passes the whole environment on to the actor processes, so a variable set for
`glmrt up` reaches every actor.
"""

from __future__ import annotations

import os

DEFAULT_URL = "http://127.0.0.1:30000"
KV_TRANSFER_MODES = ("auto", "nixl", "zmq")


def api_key() -> str | None:
    """GLMRT_API_KEY: the bearer key `glmrt up` requires and the client commands (`glmrt status`,
    `scale`, `down`, `bench serving`) send; unset: no key."""
    return os.environ.get("GLMRT_API_KEY") or None


def url() -> str:
    """GLMRT_URL: the deployment the client commands talk to (default http://127.0.0.1:30000)."""
    return os.environ.get("GLMRT_URL") or DEFAULT_URL


def sampler_kernel() -> bool:
    """GLMRT_SAMPLER_KERNEL: 0 keeps sampling on the torch path even on a GPU (default 1: the Triton
    sampling kernels wherever they run)."""
    return os.environ.get("GLMRT_SAMPLER_KERNEL") != "0"


def kv_checksum() -> bool:
    """GLMRT_KV_CHECKSUM: 1 checksums every PD state transfer on both sides (default 0: a checksum
    of GPU memory costs a device-to-host copy of the bytes)."""
    return os.environ.get("GLMRT_KV_CHECKSUM") == "1"


def kv_transfer() -> str:
    """GLMRT_KV_TRANSFER: how a prefill engine hands state to a decode engine: auto (NIXL when it
    works here, else the zmq fallback) | nixl | zmq. Default auto."""
    mode = os.environ.get("GLMRT_KV_TRANSFER") or "auto"
    if mode not in KV_TRANSFER_MODES:
        raise ValueError(f"GLMRT_KV_TRANSFER must be one of {', '.join(KV_TRANSFER_MODES)} (got {mode!r})")
    return mode
