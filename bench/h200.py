"""What the H200 benches share: the ceilings measured on an H200, and `--smoke`'s switch to
Triton's interpreter (it must happen before Triton is imported, so benches call it first).

Imports nothing heavy at module level: a bench imports this before torch and Triton.
"""

from __future__ import annotations

import os
import sys


def write_out(name: str, obj) -> str | None:
    """Write `obj` as JSON to $OUT/name when OUT is set (the folder a run's results are collected
    from) -> the path written, or None."""
    import json

    out = os.environ.get("OUT")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


CEILING_TBPS = 4.09     # measured device-to-device copy (bytes read + written)
CEILING_TFLOPS = 779.0  # measured bf16 8192^3 matmul on random data (769-798 over runs)


def _median_seconds(fn, reps: int) -> float:
    """fn() timed by CUDA events (bench.timing.event_ms) `reps` times after three warm calls ->
    the median, seconds."""
    from bench.timing import event_ms

    fn()
    fn()  # with event_ms's own, three warm calls
    return event_ms(fn, reps) * 1e-3


def measured_copy_tbps(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """This device's device-to-device copy rate, bytes read + written, TB/s: the rate
    CEILING_TBPS was measured as, taken on the device a run is on, so that a run on another GPU
    states its ratios against its own floor too."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), reps) / 1e12


def measured_matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """This device's bf16 n^3 matmul on random data, TFLOP/s: CEILING_TFLOPS measured on the
    device a run is on."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / _median_seconds(lambda: a @ b, reps) / 1e12


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


def kernel_device():
    """The device the kernels run on: CUDA, or the CPU under Triton's interpreter (--smoke);
    None (after saying why on stderr) on a CPU-only machine without --smoke."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("no CUDA device: run with --smoke (Triton interpreter) on a CPU-only machine", file=sys.stderr)
        return None
    return torch.device("cpu")


def random_page_tables(lens: list[int], page_size: int, g) -> tuple[list[list[int]], int]:
    """Page tables for requests of `lens` tokens, pages scattered at random over a pool with
    one spare page. -> (tables, num_pages)."""
    import torch

    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, c = [], 0
    for n in need:
        tables.append(perm[c:c + n])
        c += n
    return tables, num_pages
