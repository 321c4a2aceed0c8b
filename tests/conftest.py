"""The whole suite: where Triton's interpreter runs the kernels (no CUDA), every specialisation
of our kernels that the tests launch is recorded and compiled for sm90 without a GPU
(backends.kernels.compile_check): a kernel that the interpreter runs but the compiler refuses
fails the run, with the compiler's message. The compiling runs beside the tests at the lowest
CPU priority and finishes after them. GLMRT_COMPILE_CHECK=0 turns this off."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

from backends.kernels.compile_check import RECORD_ENV

_records: str | None = None  # this session's record file, while the check is on
_compiler = None  # its BackgroundCompiler


def _wanted() -> bool:
    if os.environ.get("GLMRT_COMPILE_CHECK", "1") == "0" or RECORD_ENV in os.environ:
        return False  # off, or compile_check itself runs this session and compiles afterwards
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    import torch  # not triton: imported before TRITON_INTERPRET is set, its own helpers would compile

    return not torch.cuda.is_available()


def pytest_configure(config):
    global _records, _compiler
    if not _wanted():
        return
    folder = tempfile.mkdtemp(prefix="glmrt-kernels-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    # set before any kernel module loads: patch_interpreter() installs the recorder from it, in
    # this process and in the ones the tests start
    _records = os.environ[RECORD_ENV] = os.path.join(folder, "launches.jsonl")
    from backends.kernels.compile_check import BackgroundCompiler
    _compiler = BackgroundCompiler(_records, "sm90").start()


def pytest_sessionfinish(session, exitstatus):
    if _records is None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        _compiler.cancel()
        return
    os.environ.pop(RECORD_ENV, None)
    from backends.kernels.compile_check import report

    t0 = time.time()
    recs, failed = _compiler.finish(jobs=2)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and recs:  # silent where no test launched one of our kernels
        reporter.write_line("")
        reporter.write_line(report(recs, failed, "sm90", time.time() - t0, after_tests=True), red=bool(failed))
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
