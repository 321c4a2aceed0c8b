"""backends.kernels.compile_check: the launches of an interpreted run, compiled for sm90 on a
machine without a GPU (Triton's bundled ptxas), so a kernel the interpreter runs but the compiler
refuses is caught before it reaches a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from .conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU only)")
pytest.importorskip("triton")


def test_the_compiler_refuses_what_the_interpreter_ran(tmp_path):
    from backends.kernels.compile_check import BackgroundCompiler, Recorder, compile_recorded
    from backends.kernels.interpreter import patch_interpreter

    from . import compile_samples as ks

    patch_interpreter()
    path = str(tmp_path / "launches.jsonl")
    recorder = Recorder(path, packages=(ks.__name__,))
    beside = BackgroundCompiler(path, "sm90", interval_s=0.2).start()  # as the suite's check runs
    try:
        x, out = torch.arange(5, dtype=torch.float32), torch.zeros(1)
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=8)
        assert out.item() == 4.0
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=8)   # the same specialisation: one record
        ks.row_max_kernel[(1,)](x, out, 3, BLOCK=4)   # another
        deadline = time.monotonic() + 300
        while beside.compiled < 2 and time.monotonic() < deadline:  # compiled while the run goes on
            time.sleep(0.2)
        assert beside.compiled == 2
        ks.loop_reshaped_kernel[(1,)](x, out, 5, BLOCK=8, SMALL=2)
        assert out.item() == 2.0  # the interpreter runs it: 1 + x[0] + x[1]
    finally:
        recorder.uninstall()

    for recs, failed in (compile_recorded(path, "sm90", jobs=1), beside.finish(jobs=1)):
        assert len(recs) == 3
        assert [r["name"] for r, _ in failed] == ["loop_reshaped_kernel"]
        assert "Loop-carried variable hit" in failed[0][1]
    lines = (tmp_path / "launches.jsonl").read_text().splitlines()
    assert len(lines) == 3
