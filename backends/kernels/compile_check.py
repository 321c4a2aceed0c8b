"""Compile, for a GPU, every kernel specialisation an interpreted run launched; no GPU needed.

    python3 -m backends.kernels.compile_check [--target sm90] [--jobs N] -- PYTEST_ARGS...

Triton's interpreter (TRITON_INTERPRET=1, how the kernel tests run without CUDA) executes a
kernel's Python with numpy and never checks it the way the compiler does: a name carried into
a loop with another shape, a constexpr used as a value, a layout the compiler's passes cannot
resolve all run there and fail on the GPU. This runs the given pytest command with the
interpreter and a recorder on: each launch of a kernel of this package notes what Triton's own
binder would hand the compiler (argument types, pointer alignments, constexpr values, launch
options). It then compiles each distinct specialisation for the target, in child interpreters
without TRITON_INTERPRET, down to the cubin that Triton's bundled ptxas writes. Exit status 1
when one fails (or the tests do). Shared memory is not held against the target's: a launcher may
ask for more and shrink its tiles on the OutOfResources that Triton raises at the first launch
(the fused MoE's does, for its per-element dequantisation tiles).

What the interpreter launches is not all the GPU launches: a kernel's `PDL` constexpr is False
there (no programmatic dependent launch on the CPU), so each such variant is compiled with PDL
on as well; a constexpr named INTERPRET (an interpreter-only branch) is compiled as False. Tile
choices a launcher makes only under the interpreter stay as they ran: a test has to launch the
GPU's tiles too (the sampler's tests do, through `sampling.default_tiles`).

The recorder is installed by `patch_interpreter()` (which every kernel module calls), once a
process, when GLMRT_KERNEL_RECORD names a file: each new specialisation is appended there at
once, as one JSON line in one write, so the processes a test starts and kills add theirs too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

RECORD_ENV = "GLMRT_KERNEL_RECORD"
_PACKAGE = "backends."  # whose kernels are recorded (third-party kernels are not ours to check)
_TARGETS = {"sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32)}
_CHILD_TIMEOUT_S = 1800
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- recording (in the interpreted process) -----------------------------------------------------
class Recorder:
    """Wraps the interpreter's launch so each distinct specialisation of a kernel defined in one
    of `packages` (module-name prefixes) is appended to `path` when it first completes.
    Recorders stack; uninstall() the last one first."""

    def __init__(self, path: str, packages: tuple[str, ...] = (_PACKAGE,)):
        from triton.runtime import interpreter as _interp

        self.path, self.packages, self.seen = path, packages, set()
        self._cls = _interp.InterpretedFunction
        self._run = run = self._cls.run
        recorder = self

        def recording_run(interp_fn, *args, grid, warmup, **kwargs):
            out = run(interp_fn, *args, grid=grid, warmup=warmup, **kwargs)  # a launch that raises is not noted
            if interp_fn.fn.__module__.startswith(recorder.packages):
                recorder.note(interp_fn, args, kwargs)
            return out

        self._wrapper = recording_run
        self._cls.run = recording_run

    def note(self, interp_fn, args, kwargs) -> None:
        try:
            rec = _describe(interp_fn, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a record that cannot be made is reported, not fatal
            rec = {"module": interp_fn.fn.__module__, "name": interp_fn.fn.__name__, "error": f"not recorded: {e!r}"}
        line = json.dumps(rec, sort_keys=True)
        if line in self.seen:
            return
        self.seen.add(line)
        try:  # one write on an O_APPEND descriptor: lines of concurrent processes never interleave
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:  # the session's folder is gone (a process outliving its tests)
            pass

    def uninstall(self) -> None:
        assert self._cls.run is self._wrapper, "uninstall the recorders in reverse order"
        self._cls.run = self._run


_BINDERS: dict = {}


def _describe(interp_fn, args, kwargs) -> dict:
    """The compiler's view of one launch: Triton's binder run on the launch's arguments, as
    JITFunction.run does it, for the sm90 backend (its argument specialisation is the target's)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = interp_fn.fn
    if fn not in _BINDERS:
        jit = JITFunction(fn, **{k: v for k, v in interp_fn.kwargs.items()
                                 if k in ("do_not_specialize", "do_not_specialize_on_alignment", "debug")})
        backend = make_backend(GPUTarget(*_TARGETS["sm90"]))
        _BINDERS[fn] = (jit, backend, create_function_from_signature(jit.signature, jit.params, backend))
    jit, backend, binder = _BINDERS[fn]
    kwargs = {**kwargs, "debug": kwargs.get("debug", jit.debug)}
    bound, specialization, bound_options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, bound_options)
    return {
        "module": fn.__module__, "name": fn.__name__,
        "signature": _encode(signature),
        "constexprs": [[list(path), _encode(v)] for path, v in constexprs.items()],
        "attrs": [[list(path), [list(a) for a in v]] for path, v in attrs.items()],
        "options": {k: _encode(v) for k, v in kwargs.items() if k in options.__dict__ and v is not None},
    }


def _encode(v):
    import triton.language as tl

    v = v.value if isinstance(v, tl.constexpr) else v
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tl.dtype):
        return {"tl.dtype": v.name}
    if isinstance(v, (tuple, list)):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": {k: _encode(x) for k, x in v.items()}}
    if callable(v) and hasattr(v, "__module__"):
        f = getattr(v, "fn", v)
        return {"fn": [f.__module__, f.__name__]}
    raise TypeError(f"constexpr {v!r} of type {type(v).__name__}")


# ---- compiling (in a child interpreter without TRITON_INTERPRET) ---------------------------------
def _decode(v):
    if not isinstance(v, dict):
        return v
    import importlib

    import triton.language as tl

    if "tl.dtype" in v:
        return getattr(tl, v["tl.dtype"]) if hasattr(tl, v["tl.dtype"]) else tl.dtype(v["tl.dtype"])
    if "tuple" in v:
        return tuple(_decode(x) for x in v["tuple"])
    if "dict" in v:
        return {k: _decode(x) for k, x in v["dict"].items()}
    return getattr(importlib.import_module(v["fn"][0]), v["fn"][1])


def _jit_of(obj):
    """The JITFunction under any autotune/heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def variants(rec: dict, arg_names: list[str]) -> list[tuple[str, dict, dict]]:
    """(label, constexprs, options) to compile for one record: as launched, with an INTERPRET
    constexpr False; and with PDL on where the kernel has a PDL constexpr that was off."""
    constexprs = {tuple(p): _decode(v) for p, v in rec["constexprs"]}
    options = {k: _decode(v) for k, v in rec["options"].items()}
    by_name = {arg_names[p[0]]: p for p in constexprs if len(p) == 1}
    if "INTERPRET" in by_name:
        constexprs[by_name["INTERPRET"]] = False
    out = [("", constexprs, options)]
    if "PDL" in by_name and constexprs[by_name["PDL"]] is False:
        out.append((" PDL", {**constexprs, by_name["PDL"]: True}, {**options, "launch_pdl": True}))
    return out


def jit_of_record(rec: dict):
    """The JITFunction a record was launched from."""
    import importlib

    return _jit_of(getattr(importlib.import_module(rec["module"]), rec["name"]))


def source_of(rec: dict, jit, constexprs: dict):
    """What triton.compile takes for one variant of a record."""
    from triton.compiler import ASTSource

    return ASTSource(jit, _decode(rec["signature"]), constexprs=constexprs,
                     attrs={tuple(p): [tuple(a) for a in v] for p, v in rec["attrs"]})


def compile_one(rec: dict, target: str) -> str | None:
    """None when every variant of `rec` compiles for `target`, else the compiler's messages."""
    if "error" in rec:
        return rec["error"]
    problems = []
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        jit = jit_of_record(rec)
        for label, constexprs, options in variants(rec, jit.arg_names):
            src = source_of(rec, jit, constexprs)
            err = _compile_capturing(triton.compile, src, GPUTarget(*_TARGETS[target]), options)
            if err:
                problems.append(f"[as launched{label}] {err}")
    except Exception as e:  # noqa: BLE001 - a record that cannot be rebuilt is a failure to report
        problems.append(f"{type(e).__name__}: {e}")
    return "\n".join(problems) or None


def _compile_capturing(compile_fn, src, target, options) -> str | None:
    """None, or the compiler's message: MLIR's diagnostics go to fd 2, not into the exception."""
    with tempfile.TemporaryFile(mode="w+") as diag:
        saved = os.dup(2)
        os.dup2(diag.fileno(), 2)
        try:
            compile_fn(src, target=target, options=options)
            return None
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the result
            err = f"{type(e).__name__}: {e}"
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        diag.seek(0)
        return f"{_diagnostics(diag.read())}\n{err}".strip()


def _diagnostics(text: str, keep: int = 40) -> str:
    """MLIR's output for a failed pass: its messages, not the reproducer module it dumps after them."""
    lines = text.splitlines()
    cut = next((i for i, ln in enumerate(lines) if ln.startswith(("module {", "#loc", "{-#"))), len(lines))
    head = lines[:min(cut, keep)]
    tail = [ln for ln in lines[cut:] if ": error:" in ln or ": note:" in ln]
    return "\n".join(head + tail)


_COMPILE_ONE = "backends.kernels.compile_check:compile_one"


def _compile_batch(records: list[dict], target: str, tmp: str, nice: bool = False,
                   fn: str = _COMPILE_ONE) -> list:
    """`fn` ("module:function", compile_one by default) of each record of a batch, in a fresh child
    interpreter (TRITON_INTERPRET off; a private cache and temp folder; this process's import path;
    with `nice`, at the lowest CPU priority); its results must be JSON. A child that dies takes its
    records one by one; a record whose child dies gets the message why."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", RECORD_ENV)}
    env.update(TRITON_CACHE_DIR=os.path.join(tmp, "cache"), TMPDIR=tmp,
               PYTHONPATH=os.pathsep.join([_ROOT, *(p for p in sys.path if p)]))
    # a background child: lowest priority, and killed with the thread that started it (a run
    # stopped early leaves no compiler behind; Linux's PR_SET_PDEATHSIG, skipped elsewhere)
    code = (("import ctypes, os\nos.nice(19)\ntry:\n    ctypes.CDLL(None).prctl(1, 9)\nexcept (OSError, AttributeError):\n"
             "    pass\n" if nice else "") +
            f"import json, sys\nfrom {fn.split(':')[0]} import {fn.split(':')[1]} as fn\n"
            "recs = json.load(sys.stdin)\n"
            f"print(json.dumps([fn(r, {target!r}) for r in recs]))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(records), env=env, cwd=_ROOT,
                             capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S, check=False)
        results = _results_line(out.stdout, len(records)) if out.returncode == 0 else None
        if results is not None:
            return results
        why = f"the compiling process died (status {out.returncode}): {out.stderr.strip()[-2000:]}"
    except subprocess.TimeoutExpired:
        why = f"compiling took over {_CHILD_TIMEOUT_S} s"
    if len(records) == 1:
        return [why]
    return [r for rec in records for r in _compile_batch([rec], target, tmp, nice, fn)]


def _results_line(stdout: str, n: int) -> list[str | None] | None:
    """The child's last line, its n results; None when it is not that (a stray print, no output)."""
    lines = stdout.strip().splitlines()
    try:
        results = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return results if isinstance(results, list) and len(results) == n else None


def read_records(path: str) -> list[dict]:
    """The distinct records of a file (lines that are not whole records are skipped)."""
    recs = {}
    with open(path) as f:
        for line in f:
            try:
                recs.setdefault(line.strip(), json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(recs.values(), key=lambda r: (r["module"], r["name"]))


def compile_parallel(recs: list[dict], target: str, tmp: str, jobs: int, fn: str = _COMPILE_ONE) -> list:
    """Each record's result of `fn` (as _compile_batch), `jobs` child compilers at once."""
    batches = [recs[i::jobs] for i in range(jobs) if recs[i::jobs]]
    with concurrent.futures.ThreadPoolExecutor(len(batches) or 1) as pool:
        results = list(pool.map(lambda b: _compile_batch(b, target, tmp, fn=fn), batches))
    by_id = {id(r): msg for b, res in zip(batches, results) for r, msg in zip(b, res)}
    return [by_id[id(r)] for r in recs]


def compile_recorded(path: str, target: str = "sm90", jobs: int = 2) -> tuple[list[dict], list[tuple[dict, str]]]:
    """Compile each distinct record of `path`: (the records, the failures each with its message)."""
    recs = read_records(path) if os.path.exists(path) else []
    with tempfile.TemporaryDirectory(prefix="glmrt-compile-", ignore_cleanup_errors=True) as tmp:
        results = compile_parallel(recs, target, tmp, jobs)
    return recs, [(r, msg) for r, msg in zip(recs, results) if msg]


def _key(rec: dict) -> str:
    return json.dumps(rec, sort_keys=True)


class BackgroundCompiler:
    """compile_recorded, started while the records are still being written: a thread compiles the
    records seen so far in one child at a time at the lowest CPU priority, so the compiling takes
    the CPU the tests leave idle; finish() compiles what is left at full priority and returns what
    compile_recorded returns."""

    def __init__(self, path: str, target: str = "sm90", interval_s: float = 15.0, batch: int = 24):
        self.path, self.target, self.interval_s, self.batch = path, target, interval_s, batch
        self._tmp = tempfile.mkdtemp(prefix="glmrt-compile-")
        self._results: dict[str, str | None] = {}
        self._busy: set[str] = set()  # keys of the batch a child compiles now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-compile-check", daemon=True)

    def start(self) -> "BackgroundCompiler":
        self._thread.start()
        return self

    def _pending(self) -> list[dict]:
        recs = read_records(self.path) if os.path.exists(self.path) else []
        with self._lock:
            return [r for r in recs if _key(r) not in self._results and _key(r) not in self._busy]

    def _run(self) -> None:
        while not self._stop.is_set():
            todo = self._pending()[:self.batch]
            if not todo:
                self._stop.wait(self.interval_s)
                continue
            with self._lock:
                self._busy = {_key(r) for r in todo}
            results = _compile_batch(todo, self.target, self._tmp, nice=True)
            with self._lock:
                self._results.update((_key(r), msg) for r, msg in zip(todo, results))
                self._busy = set()

    @property
    def compiled(self) -> int:
        """Records compiled so far."""
        with self._lock:
            return len(self._results)

    def cancel(self) -> None:
        """Take no new batch (the one in a child ends with this process)."""
        self._stop.set()

    def finish(self, jobs: int = 2) -> tuple[list[dict], list[tuple[dict, str]]]:
        """Stop taking new records, compile the rest (beside the batch still in a child), return
        (the records, the failures each with its message)."""
        self._stop.set()
        rest = self._pending()
        rest_results = compile_parallel(rest, self.target, self._tmp, jobs)
        self._thread.join()
        self._results.update((_key(r), msg) for r, msg in zip(rest, rest_results))
        late = self._pending()  # written while the rest compiled (none once the tests are over)
        self._results.update((_key(r), msg) for r, msg in zip(late, compile_parallel(late, self.target, self._tmp, jobs)))
        shutil.rmtree(self._tmp, ignore_errors=True)
        recs = read_records(self.path) if os.path.exists(self.path) else []
        return recs, [(r, self._results[_key(r)]) for r in recs if self._results.get(_key(r))]


def report(recs: list[dict], failed: list[tuple[dict, str]], target: str, seconds: float,
           after_tests: bool = False) -> str:
    """The summary line, then each failure: its kernel, constexprs and the compiler's message.
    `after_tests`: `seconds` is what the compiling took past the tests (it ran beside them)."""
    kernels = {(r["module"], r["name"]) for r in recs}
    took = f"{seconds:.0f} s past the tests" if after_tests else f"in {seconds:.0f} s"
    lines = [(f"kernel compile check: {len(recs)} specialisations of {len(kernels)} kernels compiled for {target} "
              f"{took}, {len(recs) - len(failed)} ok, {len(failed)} failed")]
    for rec, msg in failed:
        lines += [f"--- {rec['module']}.{rec['name']}: constexprs {json.dumps(rec.get('constexprs', []))}", msg]
    return "\n".join(lines)


def record_launches(pytest_args: list[str], path: str) -> int:
    """Run pytest (default: tests/backends) under the interpreter with the recorder writing to
    `path`; its exit status."""
    env = {**os.environ, "TRITON_INTERPRET": "1", RECORD_ENV: os.path.abspath(path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(pytest_args or ["tests/backends"])], env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m backends.kernels.compile_check", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="sm90", choices=sorted(_TARGETS))
    p.add_argument("--jobs", type=int, default=2, help="child compilers at once")
    p.add_argument("--records", default=None,
                   help="keep the launches' records in this file (appended to: start from a missing file, or "
                        "records of kernels since changed are compiled too)")
    p.add_argument("--from-records", default=None, help="compile this file's records; run no tests")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest command's arguments")
    args = p.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    tests_rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.from_records or args.records or os.path.join(tmp, "launches.jsonl")
        if not args.from_records:
            t0 = time.time()
            tests_rc = record_launches(pytest_args, path)
            print(f"tests: exit status {tests_rc} in {time.time() - t0:.0f} s")
        t0 = time.time()
        recs, failed = compile_recorded(path, args.target, args.jobs)
        print(report(recs, failed, args.target, time.time() - t0))
    return 1 if failed or not recs or tests_rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
