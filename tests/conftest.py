"""The whole suite: where Triton's interpreter runs the kernels (no CUDA), every specialisation
of our kernels that the tests launch is recorded, and at the end compiled for sm90 without a GPU
(backends.kernels.compile_check): a kernel that the interpreter runs but the compiler refuses
fails the run, with the compiler's message. GLMRT_COMPILE_CHECK=0 turns this off."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from backends.kernels.compile_check import RECORD_ENV


def _wanted() -> bool:
    if os.environ.get("GLMRT_COMPILE_CHECK", "1") == "0" or RECORD_ENV in os.environ:
        return False  # off, or compile_check itself runs this session and compiles afterwards
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    import torch  # not triton: imported before TRITON_INTERPRET is set, its own helpers would compile

    return not torch.cuda.is_available()


_DIR = tempfile.mkdtemp(prefix="glmrt-kernels-") if _wanted() else None
if _DIR:
    # set before any kernel module loads: patch_interpreter() installs the recorder from it, in
    # this process and in the ones the tests start
    os.environ[RECORD_ENV] = os.path.join(_DIR, "launches.jsonl")


def pytest_sessionfinish(session, exitstatus):
    if not _DIR:
        return
    path = os.environ.pop(RECORD_ENV)
    from backends.kernels import interpreter

    if interpreter._RECORDER is not None:
        interpreter._RECORDER.flush()
    try:
        if not os.path.exists(path):
            return
        from backends.kernels.compile_check import compile_recorded

        t0 = time.time()
        failed = compile_recorded(path, "sm90", jobs=2)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"kernel compile check (sm90, {time.time() - t0:.0f} s): {len(failed)} failed"]
        for rec, msg in failed:
            lines += [f"--- {rec['module']}.{rec['name']}", msg]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=bool(failed))
        if failed:
            session.exitstatus = 1
    finally:
        shutil.rmtree(_DIR, ignore_errors=True)
