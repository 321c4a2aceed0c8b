"""Backend registry: detect the hardware and hand out a kernel set by name.

`auto` picks the best backend the machine has. The hardware kernel sets (cuda-h200,
cuda-blackwell, rocm-mi355x) live in modules that register themselves when imported; the
registry imports one lazily, only on its hardware, so detection never imports Triton or CUDA
libraries eagerly. Their defaults and legal option combinations are in `backends.adapters`.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .adapters import BACKEND_NAMES, BackendError  # noqa: F401  (torch-free: `glmrt up` checks options without torch)
from .reference import ReferenceOps


@dataclass(frozen=True)
class Backend:
    name: str
    ops: Any
    device: str
    description: str


def detect_hardware() -> str:
    """'sm90', 'sm100', 'gfx950', 'cuda-other', 'rocm-other' or 'cpu'."""
    if not torch.cuda.is_available():
        return "cpu"
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName
        return "gfx950" if arch.startswith("gfx950") else "rocm-other"
    major, minor = torch.cuda.get_device_capability(0)
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    return "cuda-other"


_REQUIRED_HW = {"cuda-h200": ("sm90",), "cuda-blackwell": ("sm100",), "rocm-mi355x": ("gfx950",)}
_MODULES = {"cuda-h200": ".cuda_h200", "cuda-blackwell": ".cuda_blackwell", "rocm-mi355x": ".rocm_mi355x"}
_FACTORIES: dict[str, Callable[[], Any]] = {"reference": ReferenceOps}


def register(name: str, factory: Callable[[], Any]) -> None:
    """Install the kernel set of a hardware backend (called by its module when it loads)."""
    if name not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    _FACTORIES[name] = factory


def resolve_name(name: str, hardware: str | None = None) -> str:
    hw = hardware or detect_hardware()
    for cand, need in _REQUIRED_HW.items():
        if hw in need and name in ("auto", cand) and cand not in _FACTORIES:
            with contextlib.suppress(ImportError):  # the module registers itself; it needs Triton
                importlib.import_module(_MODULES[cand], __package__)
    if name == "auto":
        for cand, need in _REQUIRED_HW.items():
            if hw in need and cand in _FACTORIES:
                return cand
        return "reference"
    if name not in BACKEND_NAMES:
        raise BackendError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKEND_NAMES)}")
    if name in _REQUIRED_HW and hw not in _REQUIRED_HW[name]:
        raise BackendError(f"backend {name!r} needs {'/'.join(_REQUIRED_HW[name])} hardware but this machine is "
                           f"{hw}; use --backend auto or reference")
    if name not in _FACTORIES:
        raise BackendError(f"backend {name!r} has no kernel set installed in this build; "
                           "use --backend reference")
    return name


def get_backend(name: str = "auto", device: str | None = None) -> Backend:
    resolved = resolve_name(name)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return Backend(resolved, _FACTORIES[resolved](), dev, f"{resolved} kernels on {dev}")
