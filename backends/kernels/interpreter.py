"""Triton interpreter (TRITON_INTERPRET=1) support: every interpreter-only patch, in one place.

Triton's interpreter runs @triton.jit kernels with numpy on CPU tensors (the kernel tests
without CUDA). Triton 3.6's interpreter differs from compiled code in a few ways that these
patches fix or speed up; each is a no-op unless TRITON_INTERPRET is set, and compiled (GPU)
runs never see any of them.

  patch_interpreter()               every kernel module calls it when it loads (idempotent):
                                    the fixes that every kernel here relies on
  patch_interpreter(fla_chunk=True) also the three fixes fla's chunk_kda needs (tests only,
                                    via backends.kernels.kda.enable_interpreted_chunk)

Each patch marks what it replaced (a `_glmrt_*` attribute), so applying it twice is a no-op.
This module imports neither Triton nor numpy when it loads (`backends.kernels` re-exports
from it); a patch imports them when it is applied.
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether TRITON_INTERPRET is set now (INTERPRET: when this module was loaded)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- bf16 <-> fp32 on the interpreter's raw storage --------------------------------------------
def bf16_bits_to_f32(bits):
    """Triton's interpreter stores bf16 as raw uint16: widen those bits to float32 (exact)."""
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(data):
    """float32 -> bf16 bits, rounded to nearest even as compiled code and torch do (NaN stays NaN)."""
    import numpy as np

    data = np.asarray(data, dtype=np.float32)
    b = data.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), ((b >> 16) | 0x40).astype(np.uint16), r)


def f32_to_e4m3_bits(data):
    """float32 -> fp8 e4m3fn bits, rounded to nearest even and saturated at +-448, as sm90's
    `cvt.rn.satfinite.e4m3x2.f32` does (NaN stays NaN); torch does the rounding."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# ---- the entry point ---------------------------------------------------------------------------
_RECORDER = None  # compile_check's launch recorder of this process, when one is asked for


def patch_interpreter(*, fla_chunk: bool = False) -> None:
    """Apply the interpreter patches (idempotent; nothing unless TRITON_INTERPRET is set).

    Always: tensor `__index__` (#9171), bf16 `tl.dot`, bf16 and fp8 e4m3 cast rounding, boolean `&|^`,
    fast device calls, no overflow sanitiser work. With `fla_chunk`: tensor loop variables,
    no autotune benchmarking, bf16 elementwise math (process-wide; what fla's chunk_kda needs).
    """
    if not interpreting():
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover - triton without an interpreter
        return
    _patch_tensor_index(_interp)
    _patch_bf16_dot(_interp)
    _patch_bf16_cast_rounding(_interp)
    _patch_bool_ops(_interp)
    _patch_device_calls(_interp)
    _patch_overflow_checks(_interp)
    global _RECORDER
    from .compile_check import RECORD_ENV, Recorder  # imports neither Triton nor torch

    if os.environ.get(RECORD_ENV) and _RECORDER is None:
        _RECORDER = Recorder(os.environ[RECORD_ENV])
    if fla_chunk:
        _patch_loop_tensors(_interp)
        _patch_bf16_math(_interp)
        _patch_autotune_no_bench()


# ---- the patches applied by every kernel module ------------------------------------------------
# Limitation: with numpy >= 2.4 a run-time scalar cannot be a loop bound (triton-lang/triton#9171).
def _patch_tensor_index(_interp) -> None:
    """`int()` of a 1-element array raises: re-register tensor `__index__` with a squeeze, as the
    upstream fix does."""
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is not None and not getattr(orig, "_glmrt_patched", False):
        def _patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _patched._glmrt_patched = True  # type: ignore[attr-defined]
        _interp._patch_lang_tensor = _patched


# Limitation: `tl.dot` on bfloat16 operands multiplies their raw uint16 storage.
def _patch_bf16_dot(_interp) -> None:
    """Widen bf16 operands to fp32 first (exact): what the GPU's bf16 MMA with fp32 accumulation computes."""
    import triton.language as tl

    builder = getattr(_interp, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    if dot is not None and not getattr(dot, "_glmrt_patched", False):
        def _widen(h):
            if h.dtype.scalar == tl.bfloat16:
                return _interp.TensorHandle(bf16_bits_to_f32(h.data), tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot._glmrt_patched = True  # type: ignore[attr-defined]
        builder.create_dot = create_dot


# Limitation: fp32 -> bf16 casts truncate, and fp32 -> fp8 e4m3 casts neither carry a rounded-up
# mantissa into the exponent nor break ties to even (compiled code and torch round to nearest even).
def _patch_bf16_cast_rounding(_interp) -> None:
    """A plain `x.to(tl.bfloat16)` is cast_impl with no rounding mode; the kernels round to the model
    dtype mid-computation (HF order), so truncation would cost ~1 ulp everywhere. Shares its rounding
    with f32_to_bf16_bits."""
    import triton.language as tl

    builder = getattr(_interp, "InterpreterBuilder", None)
    orig = getattr(builder, "cast_impl", None)
    if orig is None or getattr(orig, "_glmrt_rtne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _interp.TensorHandle(f32_to_bf16_bits(src.data), tl.bfloat16)
        return orig(self, src, dst_type)

    cast_impl._glmrt_rtne = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl
    to_fp = builder.create_fp_to_fp  # fp8 casts go this way (with a rounding mode)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return _interp.TensorHandle(f32_to_e4m3_bits(src.data), tl.float8e4nv)
        return to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp


# Limitation: `&`, `|`, `^` of float comparisons raise (their int1 results hold float 0.0/1.0 data).
def _patch_bool_ops(_interp) -> None:
    """A comparison's result is stored in the dtype of its operands, so `valid & (z > t)` hits numpy's
    bitwise_and on float32. When either side holds float data the operands are booleans: combine
    them logically. Only such calls, which fail otherwise, change."""
    import numpy as np
    import triton.language as tl

    builder = getattr(_interp, "InterpreterBuilder", None)
    for name, logical in (("create_and", np.logical_and), ("create_or", np.logical_or),
                          ("create_xor", np.logical_xor)):
        orig = getattr(builder, name, None)
        if orig is None or getattr(orig, "_glmrt_bool", False):
            continue

        def op(self, lhs, rhs, _orig=orig, _logical=logical):
            if lhs.data.dtype.kind == "f" or rhs.data.dtype.kind == "f":
                return _interp.TensorHandle(_logical(lhs.data != 0, rhs.data != 0), tl.int1)
            return _orig(self, lhs, rhs)

        op._glmrt_bool = True  # type: ignore[attr-defined]
        setattr(builder, name, op)


# Limitation: every call of a @triton.jit helper re-patches triton.language (~5 ms a call: slow).
def _patch_device_calls(_interp) -> None:
    """When the callee's language modules are already patched (the enclosing launch or an earlier call
    did it, with the same stateless builder) the call goes straight to the rewritten function."""
    import inspect

    import triton.language as tl

    cls = getattr(_interp, "InterpretedFunction", None)
    orig = getattr(cls, "__call__", None)
    if orig is None or getattr(orig, "_glmrt_fast", False) or not hasattr(cls, "rewrite"):
        return

    def __call__(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(not tl.core.is_builtin(getattr(lang, "where", None)) for lang in langs):
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise _interp.InterpreterError(repr(e)) from e
        return orig(self, *args, **kwargs)

    __call__._glmrt_fast = True  # type: ignore[attr-defined]
    cls.__call__ = __call__


# Limitation: every int32 add/sub/mul is redone in int64 for an overflow check that is dropped unless debug.
def _patch_overflow_checks(_interp) -> None:
    """~1.7 ms per op, a third of the sampling kernels' interpreted time. With TRITON_DEBUG off that
    work has no effect, so turn it off; with TRITON_DEBUG=1 the checks stay."""
    import dataclasses

    builder = getattr(_interp, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is not None and not opts.debug and getattr(opts, "sanitize_overflow", False):
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)


# Limitation: tl.sort is a @triton.jit bitonic network that the interpreter runs op by op.
def np_sort_desc(keys):
    """Interpreter stand-in for tl.sort(keys, descending=True) (numpy; same result), called by the
    sampling kernels under a constexpr `if INTERPRET:` branch only."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    data = np.sort(keys.handle.data)[::-1].copy()
    return tl.tensor(_interp.TensorHandle(data, keys.handle.dtype), keys.type)


# Referenced only under `if INTERPRET:` (a constexpr branch the compiler never visits); the
# flag keeps Triton's dependency scan from rejecting a plain Python function.
np_sort_desc.__triton_builtin__ = True  # type: ignore[attr-defined]


# ---- the fla chunk_kda patches (patch_interpreter(fla_chunk=True)) -----------------------------
# Limitation: `range` / `tl.range` loop variables are Python ints (tensors in compiled code).
def _patch_loop_tensors(_interp) -> None:
    """fla calls `.to(tl.int64)` on them: the AST rewrite wraps the loop variable as a tensor at the
    top of each iteration (what compiled code sees)."""
    import ast

    tr = _interp.ASTTransformer
    if getattr(tr, "_glmrt_loop_tensors", False):
        return

    def visit_For(self, node):
        self.generic_visit(node)
        it = node.iter
        name = getattr(it.func, "id", getattr(it.func, "attr", None)) if isinstance(it, ast.Call) else None
        if name == "range" and isinstance(node.target, ast.Name):
            wrap = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                              value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic",
                                                                               ctx=ast.Load()),
                                                                attr="to_tensor", ctx=ast.Load()),
                                             args=[ast.Name(id=node.target.id, ctx=ast.Load()),
                                                   ast.Constant(value=False)], keywords=[]))
            node.body.insert(0, wrap)
            ast.fix_missing_locations(node)
        return node

    tr.visit_For = visit_For
    tr._glmrt_loop_tensors = True


# Limitation: autotuned kernels benchmark every config through the GPU driver, absent here.
def _patch_autotune_no_bench() -> None:
    """Skip the timing: the autotuner takes the first config."""
    from triton.runtime import autotuner

    if not getattr(autotuner.Autotuner, "_glmrt_no_bench", False):
        autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]
        autotuner.Autotuner._glmrt_no_bench = True


_BF16_ARITH = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_precise_divf", "create_frem",
               "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf", "create_fma",
               "create_exp", "create_exp2", "create_log", "create_log2", "create_sqrt", "create_precise_sqrt",
               "create_rsqrt", "create_sin", "create_cos", "create_erf", "create_floor", "create_ceil")
_BF16_CMP = tuple(f"create_fcmp{c}" for c in ("OLT", "OGT", "OLE", "OGE", "OEQ", "ONE",
                                              "ULT", "UGT", "ULE", "UGE", "UEQ", "UNE"))


# Limitation: elementwise float ops on bf16 run on the raw uint16 storage (1.5 * 2 gives 0).
def _patch_bf16_math(interpreter) -> None:
    """fla multiplies bf16 operands (beta, k): float ops on bf16 now widen to fp32 and round the
    result back to nearest even, what compiled code does."""
    import triton.language as tl

    b = interpreter.InterpreterBuilder
    if getattr(b, "_glmrt_bf16_math", False):
        return
    th = interpreter.TensorHandle

    def widen(h):
        if isinstance(h, th) and h.dtype.scalar == tl.bfloat16:
            return th(bf16_bits_to_f32(h.data), tl.float32)
        return h

    def narrow(h):  # fp32 -> bf16, round to nearest even (NaN stays NaN)
        return th(f32_to_bf16_bits(h.data), tl.bfloat16)

    def wrap(orig, back):
        def op(self, *args):
            is_bf = any(isinstance(a, th) and a.dtype.scalar == tl.bfloat16 for a in args)
            out = orig(self, *(widen(a) for a in args))
            return narrow(out) if is_bf and back else out
        return op

    for name in _BF16_ARITH + _BF16_CMP:
        orig = getattr(b, name, None)
        if orig is not None:
            setattr(b, name, wrap(orig, name in _BF16_ARITH))
    b._glmrt_bf16_math = True
