"""Does a prefill batch of a new size or request count compile kernels mid-traffic? KDA's
chunked prefill (the op that stalled the H200 serving sweep 10 s per new multiple of 1024
tokens: fla's in-kernel l2norm autotuned per size) at the flash shapes (64 heads x 128), run
over token counts 1024..16384 and request counts 1..64; `glmrt.engine.compile_watch` counts
the Triton compiles of each call. After the first calls of each request-count class nothing
should compile. Run on the lent GPU: python3 -m bench.prefill_variants
"""

from __future__ import annotations

import argparse
import time

import torch

from backends.cuda_h200 import CudaH200Ops
from backends.kernels import kda as kk
from backends.meta import BatchMeta
from glmrt.engine import compile_watch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--max-k", type=int, default=16, help="token counts 1024 x 1..max_k")
    p.add_argument("--old-path-calls", type=int, default=3, help="calls that also time fla's l2norm")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    from fla.modules.norm.l2norm import l2norm_fwd
    compile_watch.install()
    ops = CudaH200Ops()
    h, d = args.heads, args.dim
    slots = 128
    state = torch.zeros(slots, h, d, d, device=dev, dtype=torch.float32)
    rows = []
    cases = [(k, [1024] * k) for k in range(1, args.max_k + 1)]                # one request per 1024
    cases += [(k, [1024 * k]) for k in (3, 6, 7, 10, 13)]                     # one long request
    cases += [(n, [16384 // n] * n) for n in (3, 17, 32, 64)]                 # many short ones
    for label, seq in cases:
        n_tok = sum(seq)
        meta = BatchMeta.build([0] * len(seq), seq, list(range(len(seq))), [[0]] * len(seq), 64 * 1024, dev)
        q, k, v = (torch.randn(n_tok, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = -torch.rand(n_tok, h, d, device=dev) * 0.1
        beta = torch.rand(n_tok, h, device=dev, dtype=torch.bfloat16)
        assert kk.supports(q, k, v, g, beta, state)  # the fla path, not the reference
        compile_watch.take()
        torch.cuda.synchronize()
        t = time.perf_counter()
        ops.kda(q, k, v, g, beta, state, meta)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        ours = len(compile_watch.take())
        old = "-"
        if len(rows) < args.old_path_calls:  # each new size autotunes ~25 variants: a few suffice
            l2norm_fwd(q[None])  # what chunk_kda's use_qk_l2norm_in_kernel=True ran first (the old path)
            torch.cuda.synchronize()
            old = len(compile_watch.take())
        rows.append((len(seq), n_tok, ours, old, ms))
    print("requests tokens  compiles(ours)  compiles(fla l2norm, old path)  ms(ours)")
    for r in rows:
        print(f"{r[0]:>8} {r[1]:>6} {r[2]:>14} {r[3]:>31} {r[4]:>9.1f}")
    late = [r for r in rows[4:] if r[2]]
    print(f"calls after the first four that compiled: ours {len(late)}, "
          f"fla l2norm (first {args.old_path_calls} calls) {[r[3] for r in rows[:args.old_path_calls]]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
