"""Programmatic dependent launch (PDL, SM90+) for the Triton kernels of the decode step.

A batch-1 decode step is ~125 kernels, most of them a few microseconds long; inside a CUDA
graph each still waits for its predecessor to drain and flush before its own launch starts,
~1.5 us per kernel on the H200 (`bench.decode_profile`: replay minus the kernels' sum, 182 us
of a 1.57 ms step). With PDL a kernel is launched while its predecessor still runs: its
programs become resident and block in `griddepcontrol.wait` until the predecessor has
completed and its memory is visible, so the launch latency overlaps the predecessor's tail.

The contract for a kernel launched with `**launch(device)`:
  - it takes a `PDL: tl.constexpr` argument and calls `pdl_enter(PDL)` before its first
    global load or store, so it neither reads what the previous kernel writes nor overwrites
    what it reads before that kernel has finished (the wait covers both);
  - `pdl_enter` then lets the next kernel launch early (`griddepcontrol.launch_dependents`):
    the next kernel's own wait keeps it correct, and every program of this kernel has
    already started by the time the trigger fires, so waiting programs never take an SM
    this kernel still needs.
The chain is safe transitively: a kernel can only pass its wait once its predecessor
completed, and that predecessor could only complete after passing its own wait.

Off (PDL=False, no launch attribute) under Triton's interpreter, on CPU tensors, before
SM90, when `ENABLED` is False (benchmarks flip it to measure the difference), and for forwards
of more than MAX_TOKENS tokens: the model tells the ops its token count at the start of each
forward (`CudaH200Ops.begin_forward` -> `set_tokens`). On the H200 (bench/RESULTS.md, on and
off side by side in one run) the batch-1 decode step went 1.439 -> 1.388 ms with
PDL and the batch-16 step 4.965 -> 5.132 ms; batch 64 and 128 lost 2-4% too. The early-resident
programs of the next kernel cost the multi-wave MoE GEMMs more than the hidden launch gaps
save once the step is not launch-bound. Batches 2-15 are not measured, so only batch 1 takes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .interpreter import interpreting

ENABLED = True
MAX_TOKENS = 1
_CAPABLE: dict = {}
_tokens: int | None = None   # the current forward's token count (None: not told, e.g. a kernel bench)


def set_tokens(num_tokens: int | None) -> None:
    global _tokens
    _tokens = num_tokens


def available(device: torch.device) -> bool:
    if not ENABLED or device.type != "cuda" or interpreting():
        return False
    if _tokens is not None and _tokens > MAX_TOKENS:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _CAPABLE[idx]


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's PDL constexpr and Triton's launch flag."""
    if available(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr = False):
    """First statement of a PDL kernel: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
