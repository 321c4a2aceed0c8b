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


def test_kernel_resources_of_the_recorded_launches(tmp_path):
    """backends.kernels.kernel_resources: each recorded specialisation compiled for sm90, its
    registers, stack and shared memory read from the cubin, and the blocks an SM holds by each;
    a record the compiler refuses is an error line, not a crash."""
    from backends.kernels.compile_check import Recorder, read_records
    from backends.kernels.interpreter import patch_interpreter
    from backends.kernels.kernel_resources import blocks_per_sm, resources_of, table

    from . import compile_samples as ks

    patch_interpreter()
    path = str(tmp_path / "launches.jsonl")
    recorder = Recorder(path, packages=(ks.__name__,))
    try:
        x, out = torch.arange(5, dtype=torch.float32), torch.zeros(1)
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=8)
        ks.row_max_kernel[(1,)](x, out, 5, BLOCK=64, num_warps=8)
        ks.loop_reshaped_kernel[(1,)](x, out, 5, BLOCK=8, SMALL=2)
    finally:
        recorder.uninstall()
    recs = read_records(path)
    res = resources_of(recs, "sm90", jobs=1)  # child interpreters: this one interprets
    by_name = {}
    for rec, r in zip(recs, res):
        by_name.setdefault(rec["name"], []).append(r)
    assert all("error" in r for r in by_name["loop_reshaped_kernel"])
    small, wide = sorted(by_name["row_max_kernel"], key=lambda r: r["warps"])
    assert (small["warps"], wide["warps"]) == (4, 8)
    assert all(0 < r["regs"] <= 255 and r["stack"] == 0 and r["shared"] >= 0 for r in (small, wide))
    text = table(recs, res, "sm90")
    assert text.count("row_max_kernel") == 2 and "loop_reshaped_kernel" in text and "error" in text
    # an SM's 64K registers are allocated per warp in units of 256 from each quarter of the file,
    # its 228 KB of shared memory per block with 1 KB reserved; at most 32 blocks and 2048 threads
    assert blocks_per_sm(dict(regs=128, warps=8, shared=98304), "sm90") == (2, 2)
    assert blocks_per_sm(dict(regs=129, warps=8, shared=147456), "sm90") == (1, 1)
    assert blocks_per_sm(dict(regs=58, warps=8, shared=55296), "sm90") == (4, 4)
    assert blocks_per_sm(dict(regs=32, warps=4, shared=0), "sm90") == (16, 16)
    assert blocks_per_sm(dict(regs=104, warps=1, shared=0), "sm90") == (16, 32)   # not 19: per quarter
    assert blocks_per_sm(dict(regs=16, warps=1, shared=1024), "sm90") == (32, 32)  # the block cap
    assert blocks_per_sm(dict(regs=64, warps=4, shared=240 * 1024), "sm90") == (8, 0)  # past 227 KB
