"""backends.kernels.compile_check: the launches of an interpreted run, compiled for sm90 on a
machine without a GPU (Triton's bundled ptxas), so a kernel the interpreter runs but the compiler
refuses is caught before it reaches a GPU."""

from __future__ import annotations

import pytest
import torch

from .conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU only)")
pytest.importorskip("triton")


def test_the_compiler_refuses_what_the_interpreter_ran(tmp_path):
    from backends.kernels.compile_check import Recorder, compile_recorded
    from backends.kernels.interpreter import patch_interpreter

    from . import compile_samples as ks

    patch_interpreter()
    recorder = Recorder(str(tmp_path / "launches.jsonl"), packages=(ks.__name__,))
    try:
        x, out = torch.arange(5, dtype=torch.float32), torch.zeros(1)
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=8)
        assert out.item() == 4.0
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=8)   # the same specialisation: one record
        ks.row_max_kernel[(1,)](x, out, 3, BLOCK=4)   # another
        ks.loop_reshaped_kernel[(1,)](x, out, 5, BLOCK=8, SMALL=2)
        assert out.item() == 2.0  # the interpreter runs it: 1 + x[0] + x[1]
    finally:
        recorder.uninstall()

    recs, failed = compile_recorded(str(tmp_path / "launches.jsonl"), "sm90", jobs=1)
    assert len(recs) == 3
    assert [r["name"] for r, _ in failed] == ["loop_reshaped_kernel"]
    assert "Loop-carried variable hit" in failed[0][1]
    lines = (tmp_path / "launches.jsonl").read_text().splitlines()
    assert len(lines) == 3
