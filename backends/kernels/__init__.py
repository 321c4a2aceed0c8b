"""Triton kernels of the hardware backends (first user: `backends.cuda_h200`).

Importing a submodule imports Triton; `backends.registry` never imports this package
eagerly. Every Triton kernel here is tested against `backends.reference.ReferenceOps` on CPU
through Triton's interpreter (TRITON_INTERPRET=1) and on a GPU when one is present
(tests/backends/test_triton_*.py). The one Gluon kernel (`sparse_mla_sm90`, Hopper only; Gluon
has no interpreter) is compiled for sm_90 on CPU and checked against the Triton kernel and the
reference on a Hopper GPU (tests/backends/test_sparse_mla_sm90.py).

  sparse_mla.sparse_mla_decode   absorbed-MLA decode over gathered latent rows (split-K)
  sparse_mla.sparse_mla          ReferenceOps.sparse_mla signature; kernel for decode batches
  sparse_mla_sm90                the prefill rows on Hopper (Gluon; two warpgroups split the tiles)
  indexer.indexer_scores         DSA k-pool scores of decode queries
  indexer.indexer_select         ReferenceOps.indexer_select signature; kernel + top-k for decode

  interpreter.patch_interpreter  every Triton-interpreter (TRITON_INTERPRET=1) patch, one entry point
"""

