"""What the H200 benches share: the ceilings measured on the lent H200, and `--smoke`'s switch to
Triton's interpreter (it must happen before Triton is imported, so benches call it first).

Imports nothing heavy at module level: a bench imports this before torch and Triton.
"""

from __future__ import annotations

import os
import sys

CEILING_TBPS = 4.09     # measured device-to-device copy (bytes read + written)
CEILING_TFLOPS = 779.0  # measured bf16 8192^3 matmul on random data (KINDS.md: 769-798)


def interpret_if_smoke(argv: list[str] | None = None) -> None:
    """With --smoke on a machine without CUDA, run the kernels in Triton's interpreter."""
    if "--smoke" not in (sys.argv if argv is None else argv):
        return
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
