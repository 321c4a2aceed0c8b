"""Triton kernels of the hardware backends (first user: `backends.cuda_h200`).

Importing a submodule imports Triton; `backends.registry` never imports this package
eagerly. Every kernel here is tested against `backends.reference.ReferenceOps` on CPU
through Triton's interpreter (TRITON_INTERPRET=1) and on a GPU when one is present
(tests/backends/test_triton_kernels.py).

  sparse_mla.sparse_mla_decode   absorbed-MLA decode over gathered latent rows (split-K)
  sparse_mla.sparse_mla          ReferenceOps.sparse_mla signature; kernel for decode batches
  indexer.indexer_scores         DSA k-pool scores of decode queries
  indexer.indexer_select         ReferenceOps.indexer_select signature; kernel + top-k for decode
"""


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


def patch_triton_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter, applied only under TRITON_INTERPRET=1.

    * triton-lang/triton#9171: with numpy >= 2.4 a run-time scalar cannot be a loop bound
      (`int()` of a 1-element array raises); re-register tensor `__index__` with a squeeze,
      as the upstream fix does.
    * `tl.dot` on bfloat16 operands multiplies their raw uint16 storage; widen bf16 operands
      to fp32 first (exact), which is what the GPU's bf16 MMA with fp32 accumulation computes.
    Idempotent; the kernel modules call it when they load. Compiled (GPU) runs are untouched.
    """
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover - triton without an interpreter
        return
    import triton.language as tl

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is not None and not getattr(orig, "_glmrt_patched", False):
        def _patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _patched._glmrt_patched = True  # type: ignore[attr-defined]
        _interp._patch_lang_tensor = _patched

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
