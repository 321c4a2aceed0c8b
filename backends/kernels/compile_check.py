"""Compile, for a GPU, every kernel specialisation an interpreted run launched; no GPU needed.

    python3 -m backends.kernels.compile_check [--target sm90] [--jobs N] -- PYTEST_ARGS...

Triton's interpreter (TRITON_INTERPRET=1, how the kernel tests run without CUDA) executes a
kernel's Python with numpy and never checks it the way the compiler does: a name carried into
a loop with another shape, a constexpr used as a value, a block shape that is not a power of
two all run there and fail to compile on the GPU. This runs the given pytest command with the
interpreter and a recorder on: each launch of a kernel of this package notes what Triton's own
binder would hand the compiler (argument types, pointer alignments, constexpr values, launch
options). It then compiles each distinct specialisation for the target, in child interpreters
without TRITON_INTERPRET, down to the cubin that Triton's bundled ptxas writes, and prints the
failures with the compiler's message. Exit status 1 when one fails to compile.

The recorder is installed by `patch_interpreter()` (which every kernel module calls), once a
process, when GLMRT_KERNEL_RECORD names a file; each process appends its records there as JSON
lines.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

RECORD_ENV = "GLMRT_KERNEL_RECORD"
_PACKAGE = "backends."  # whose kernels are recorded (third-party kernels are not ours to check)
_TARGETS = {"sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32)}


# ---- recording (in the interpreted process) -----------------------------------------------------
class Recorder:
    """Wraps the interpreter's launch so each distinct specialisation of a kernel defined in one
    of `packages` (module-name prefixes) is noted; flush() appends the notes to `path`, as the
    process's exit does. Recorders stack: each wraps the launch it found and uninstall() puts that
    back."""

    def __init__(self, path: str, packages: tuple[str, ...] = (_PACKAGE,)):
        from triton.runtime import interpreter as _interp

        self.path, self.packages, self.seen = path, packages, {}
        self._cls = _interp.InterpretedFunction
        self._run = run = self._cls.run
        recorder = self

        def recording_run(self, *args, grid, warmup, **kwargs):
            if self.fn.__module__.startswith(recorder.packages):
                try:
                    rec = _describe(self, args, kwargs)
                except Exception as e:  # noqa: BLE001 - a record that cannot be made is reported, not fatal
                    rec = {"module": self.fn.__module__, "name": self.fn.__name__, "error": f"not recorded: {e!r}"}
                recorder.seen.setdefault(json.dumps(rec, sort_keys=True), rec)
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

        self._cls.run = recording_run
        atexit.register(self.flush)

    def flush(self) -> None:
        if self.seen:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in self.seen.values())
            self.seen.clear()

    def uninstall(self) -> None:
        self.flush()
        self._cls.run = self._run
        atexit.unregister(self.flush)


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
                                 if k in ("do_not_specialize", "do_not_specialize_on_alignment")})
        backend = make_backend(GPUTarget(*_TARGETS["sm90"]))
        _BINDERS[fn] = (jit, backend, create_function_from_signature(jit.signature, jit.params, backend))
    jit, backend, binder = _BINDERS[fn]
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, kwargs)
    return {
        "module": fn.__module__, "name": fn.__name__,
        "signature": signature,
        "constexprs": [[list(path), _encode(v)] for path, v in constexprs.items()],
        "attrs": [[list(path), [list(a) for a in v]] for path, v in attrs.items()],
        "options": {k: _encode(v) for k, v in kwargs.items() if k in options.__dict__},
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
    if callable(v) and hasattr(v, "__module__"):
        f = getattr(v, "fn", v)
        return {"fn": [f.__module__, f.__name__]}
    raise TypeError(f"constexpr {v!r} of type {type(v).__name__}")


# ---- compiling (in a child interpreter without TRITON_INTERPRET) ---------------------------------
def _decode(v):
    if isinstance(v, dict):
        import importlib

        import triton.language as tl

        if "tl.dtype" in v:
            return getattr(tl, v["tl.dtype"]) if hasattr(tl, v["tl.dtype"]) else tl.dtype(v["tl.dtype"])
        if "tuple" in v:
            return tuple(_decode(x) for x in v["tuple"])
        if "fn" in v:
            return getattr(importlib.import_module(v["fn"][0]), v["fn"][1])
    return v


def _jit_of(obj):
    """The JITFunction under any autotune/heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def compile_one(rec: dict, target: str) -> str | None:
    """None when `rec` compiles for `target`, else the compiler's message."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "error" in rec:
        return rec["error"]
    jit = _jit_of(getattr(importlib.import_module(rec["module"]), rec["name"]))
    constexprs = {tuple(p): _decode(v) for p, v in rec["constexprs"]}
    for path in constexprs:  # a kernel's interpreter-only branch: compiled as on the GPU
        if len(path) == 1 and jit.arg_names[path[0]] == "INTERPRET":
            constexprs[path] = False
    src = ASTSource(jit, rec["signature"], constexprs=constexprs,
                    attrs={tuple(p): [tuple(a) for a in v] for p, v in rec["attrs"]})
    # MLIR's diagnostics go to fd 2, not into the exception: keep them for the report
    with tempfile.TemporaryFile(mode="w+") as diag:
        saved = os.dup(2)
        os.dup2(diag.fileno(), 2)
        try:
            triton.compile(src, target=GPUTarget(*_TARGETS[target]),
                           options={k: _decode(v) for k, v in rec["options"].items()})
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


def _compile_batch(records: list[dict], target: str) -> list[str | None]:
    """Compile a batch in a fresh child interpreter (TRITON_INTERPRET off, a private cache)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", RECORD_ENV)}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        code = ("import json, sys\nfrom backends.kernels.compile_check import compile_one\n"
                "recs = json.load(sys.stdin)\n"
                f"print(json.dumps([compile_one(r, {target!r}) for r in recs]))\n")
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(records), env=env,
                             capture_output=True, text=True)
    if out.returncode != 0:
        return [f"child failed: {out.stderr.strip()[-2000:]}"] * len(records)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_recorded(path: str, target: str = "sm90", jobs: int = 2) -> list[tuple[dict, str]]:
    """Compile each distinct record of `path`; the failures, each with its message."""
    recs = {}
    with open(path) as f:
        for line in f:
            recs.setdefault(line.strip(), json.loads(line))
    recs = sorted(recs.values(), key=lambda r: (r["module"], r["name"]))
    batches = [recs[i::jobs] for i in range(jobs) if recs[i::jobs]]
    with concurrent.futures.ThreadPoolExecutor(len(batches) or 1) as pool:
        results = list(pool.map(lambda b: _compile_batch(b, target), batches))
    failed = [(r, msg) for b, res in zip(batches, results) for r, msg in zip(b, res) if msg]
    kernels = {(r["module"], r["name"]) for r in recs}
    print(f"compiled {len(recs)} specialisations of {len(kernels)} kernels for {target}: "
          f"{len(recs) - len(failed)} ok, {len(failed)} failed")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m backends.kernels.compile_check", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="sm90", choices=sorted(_TARGETS))
    p.add_argument("--jobs", type=int, default=2, help="child compilers at once")
    p.add_argument("--records", default=None,
                   help="keep the launches' records in this file (JSON lines; appended to)")
    p.add_argument("--from-records", default=None, help="compile this file's records; run no tests")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest command's arguments")
    args = p.parse_args(argv)
    pytest_args = [a for a in args.pytest_args if a != "--"] or ["tests/backends"]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.from_records or args.records or os.path.join(tmp, "launches.jsonl")
        if not args.from_records:
            env = {**os.environ, "TRITON_INTERPRET": "1", RECORD_ENV: os.path.abspath(path)}
            t0 = time.time()
            tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                                   env=env)
            print(f"tests: exit status {tests.returncode} in {time.time() - t0:.0f} s")
        if not os.path.exists(path):
            print("no kernel of this package was launched")
            return 1
        t0 = time.time()
        failed = compile_recorded(path, args.target, args.jobs)
        print(f"compiling took {time.time() - t0:.0f} s")
    for rec, msg in failed:
        print(f"\n--- {rec['module']}.{rec['name']}: {json.dumps(rec.get('constexprs', []))}\n{msg}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
