"""mHC pre/post kernels alone at prefill and decode sizes: launch variants side by side.

    python3 -m bench.mhc_h200 [--tokens 16384] [--variants "block_n=64;block_n=32;split=4;precision=bf16x3"]
    python3 -m bench.mhc_h200 --smoke          # tiny sizes, CPU (Triton interpreter)

Every variant of `--variants` (';'-separated `key=value,...` for backends.kernels.mhc.mhc_pre:
block_n, block_k, split, precision, num_warps, num_stages; '' = its defaults) runs on the same
streams [N, M, D] (bf16, the flash shapes M 4, D 4096, 20 Sinkhorn iterations) and is checked
against ReferenceOps.mhc_pre in fp32 (post, comb and the collapse). mhc_post is timed beside it,
and a whole boundary between sublayers (mhc_post, then mhc_pre with the input norm).
The floor is the bytes the pre block must read (the streams once, fn once) and write, over the
measured copy rate. Prints a short table last; JSON to $OUT/mhc_h200.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json

from bench.h200 import CEILING_TBPS, interpret_if_smoke, kernel_device, write_out

interpret_if_smoke()

import torch  # noqa: E402

from bench.timing import timers  # noqa: E402

FULL = dict(m=4, d=4096, iters=20)
SMOKE = dict(m=4, d=64, iters=20)


def _variant(spec: str) -> dict:
    out: dict = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        k, v = part.split("=")
        out[k.strip()] = v.strip() if k.strip() == "precision" else int(v)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _boundary_rows(args, kernel_ms, mhc, mhc_post, ref_ops, x, fn, base, scale, post, comb, iters, g) -> list[dict]:
    """One boundary between sublayers, the sublayer's output combined and the next input made:
    mhc_post then mhc_pre with the input norm, for an attention output y [N, D] and an MoE's
    unsummed rows [N, top_k, D], at each mhc.NORM_CHUNK of --norm-chunk. Floor: x and y read, the
    new streams written and read back, the input u written; rel: u against the reference's."""
    from backends.reference import MoEPartials

    n, m, d = x.shape
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(x.device, torch.bfloat16)
    out = []
    for top_k in (0, args.top_k):
        y = torch.randn(n, *((top_k,) if top_k else ()), d, generator=g).to(x.device, torch.bfloat16)
        ids = torch.randint(0, 256, (n, top_k), generator=g).to(x.device) if top_k else None
        kw = dict(ids=ids, num_experts=256) if top_k else {}
        ref = ref_ops.mhc_pre(ref_ops.mhc_post(MoEPartials(y, ids, 256) if top_k else y, x, post, comb), fn, base,
                              scale, iters, 1e-6, 1e-6, (w, 1e-5))[2]
        floor_ms = (3 * x.numel() * 2 + y.numel() * 2 + n * d * 2) / (CEILING_TBPS * 1e12) * 1e3

        def boundary():
            return mhc.mhc_pre(mhc_post.mhc_post(y, x, post, comb, **kw), fn, base, scale, iters, 1e-6, 1e-6,
                               norm=(w, 1e-5))

        for chunk in [int(c) for c in args.norm_chunk.split(",")]:
            keep, mhc.NORM_CHUNK = mhc.NORM_CHUNK, chunk
            try:
                ys = f"{top_k} MoE rows" if top_k else "one row"
                row = dict(op="post+pre", tokens=n, variant=f"y: {ys}; norm chunk {chunk}",
                           ms=kernel_ms(boundary), floor_ms=floor_ms, post_rel=float("nan"), comb_rel=float("nan"),
                           collapse_rel=_rel(boundary()[2], ref))
            finally:
                mhc.NORM_CHUNK = keep
            out.append(row)
            print("row", json.dumps(row), flush=True)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="16384,4096,64,1")
    p.add_argument("--variants", default="", help="';'-separated mhc_pre keyword sets ('' = the defaults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=8, help="the MoE rows per token of the boundary rows")
    p.add_argument("--norm-chunk", default="0,2048", help="mhc.NORM_CHUNK values the two-pass boundary rows "
                   "take in turn (0: the input norm on the whole row in one tile)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    args = p.parse_args(argv)

    from backends.kernels import mhc, mhc_post
    from backends.reference import ReferenceOps

    dev = kernel_device()
    if dev is None:
        raise SystemExit(2)
    d = SMOKE if args.smoke else FULL
    m, dd, iters = d["m"], d["d"], d["iters"]
    kernel_ms, _ = timers(dev)
    g = torch.Generator().manual_seed(args.seed)
    fn = (torch.randn((2 + m) * m, m * dd, generator=g) * (m * dd) ** -0.5).to(dev)
    base = (torch.randn((2 + m) * m, generator=g) * 0.1).to(dev)
    scale = torch.tensor([1.0, 0.5, 2.0], device=dev)
    ref_ops = ReferenceOps()
    variants = args.variants.split(";") if args.variants else [""]
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        if args.smoke:
            n = min(n, 40)
        x = torch.randn(n, m, dd, generator=g).to(dev, torch.bfloat16)
        y = torch.randn(n, dd, generator=g).to(dev, torch.bfloat16)
        ref = ref_ops.mhc_pre(x, fn, base, scale, iters, 1e-6, 1e-6)
        floor_ms = (x.numel() * 2 + fn.numel() * 4 + n * dd * 2) / (CEILING_TBPS * 1e12) * 1e3
        for spec in variants:
            kw = _variant(spec)
            try:
                got = mhc.mhc_pre(x, fn, base, scale, iters, 1e-6, 1e-6, **kw)
                ms = kernel_ms(lambda: mhc.mhc_pre(x, fn, base, scale, iters, 1e-6, 1e-6, **kw))  # noqa: B023
            except Exception as err:  # noqa: BLE001 - a variant that does not compile: say so, go on
                print("variant", spec, n, "failed:", str(err).splitlines()[0][:160], flush=True)
                continue
            row = dict(op="mhc_pre", tokens=n, variant=spec or "default", ms=ms, floor_ms=floor_ms,
                       post_rel=_rel(got[0], ref[0]), comb_rel=_rel(got[1], ref[1]), collapse_rel=_rel(got[2], ref[2]))
            rows.append(row)
            print("row", json.dumps(row), flush=True)
        post, comb = ref[0], ref[1]
        ms = kernel_ms(lambda: mhc_post.mhc_post(y, x, post, comb))  # noqa: B023
        floor_ms = (2 * x.numel() * 2 + y.numel() * 2) / (CEILING_TBPS * 1e12) * 1e3
        rows.append(dict(op="mhc_post", tokens=n, variant="default", ms=ms, floor_ms=floor_ms,
                         post_rel=float("nan"), comb_rel=float("nan"),
                         collapse_rel=_rel(mhc_post.mhc_post(y, x, post, comb), ref_ops.mhc_post(y, x, post, comb))))
        print("row", json.dumps(rows[-1]), flush=True)
        rows += _boundary_rows(args, kernel_ms, mhc, mhc_post, ref_ops, x, fn, base, scale, post, comb, iters, g)
    write_out("mhc_h200.json", rows)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(f"\nmHC kernels, M {m} x D {dd}, {iters} Sinkhorn iterations, bf16 streams, on {name}; floor = bytes "
          f"over {CEILING_TBPS} TB/s")
    print(f"{'op':>8} {'tokens':>6} {'variant':<44} {'ms':>8} {'floor':>7} {'/floor':>6} {'post rel':>9} "
          f"{'comb rel':>9} {'out rel':>9}")
    for r in rows:
        print(f"{r['op']:>8} {r['tokens']:>6} {r['variant'][:44]:<44} {r['ms']:>8.3f} {r['floor_ms']:>7.3f} "
              f"{r['ms'] / r['floor_ms']:>6.1f} {r['post_rel']:>9.1e} {r['comb_rel']:>9.1e} {r['collapse_rel']:>9.1e}")
    return rows


if __name__ == "__main__":
    main()
