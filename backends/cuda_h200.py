"""The `cuda-h200` kernel set: ReferenceOps with Triton kernels on the decode hot path.

Importing this module registers the backend (`registry.register("cuda-h200", CudaH200Ops)`);
`backends.registry` imports it lazily, only when resolving a name on SM90 hardware, so the
registry itself never imports Triton. If Triton is missing the import fails with ImportError
and the registry keeps the reference. Triton itself is imported on the first kernel call.

Overridden today (everything else is the reference):
  indexer_select  decode batches (one token per request): Triton scores + tie-broken top-k
  sparse_mla      decode batches: Triton absorbed-MLA over the selected latent rows
Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
the tests); anything else takes the reference path.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .meta import BatchMeta
from .reference import ReferenceOps
from .registry import register

try:
    _HAVE_TRITON = importlib.util.find_spec("triton") is not None
except ValueError:  # triton blocked in sys.modules
    _HAVE_TRITON = False
if not _HAVE_TRITON:
    raise ImportError("the cuda-h200 backend needs Triton (pip install triton)")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kernel_ok(t: torch.Tensor, meta: BatchMeta) -> bool:
    if not (t.is_cuda or _interpreting()):
        return False
    return meta.num_reqs > 0 and all(s == 1 for s in meta.seq_lens)


class CudaH200Ops(ReferenceOps):
    """ReferenceOps with the decode-path DSA indexer and sparse MLA on Triton kernels."""

    name = "cuda-h200"

    def indexer_select(self, q: torch.Tensor, w: torch.Tensor, pooled: torch.Tensor, meta: BatchMeta,
                       kpool: int, topk_pools: int) -> torch.Tensor:
        if not _kernel_ok(q, meta) or not pooled.is_contiguous():
            return super().indexer_select(q, w, pooled, meta, kpool, topk_pools)
        from .kernels.indexer import indexer_select
        return indexer_select(q, w, pooled, meta, kpool, topk_pools)

    def sparse_mla(self, q: torch.Tensor, cache: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                   sel: torch.Tensor | None, meta: BatchMeta, kpool: int, scale: float,
                   with_tail: bool = True) -> torch.Tensor:
        if not _kernel_ok(q, meta) or not cache.is_contiguous():
            return super().sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail)
        from .kernels.sparse_mla import sparse_mla
        return sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, with_tail)


register("cuda-h200", CudaH200Ops)
