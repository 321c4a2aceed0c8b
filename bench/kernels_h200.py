"""Decode kernels of the cuda-h200 backend on the GPU: sparse MLA and the DSA indexer.

    python3 -m bench.kernels_h200                      # full grid, H200 (torch + triton only)
    python3 -m bench.kernels_h200 --sweep              # + block-shape sweep of the MLA kernel
    python3 -m bench.kernels_h200 --smoke              # tiny sizes; on a CPU-only machine it runs
                                                       # the kernels in Triton's interpreter

For each batch B (1, 16, 64, 128) and context (4K, 32K, 128K tokens per request) at full size
(H 64, kv_lora_rank R 512, qk_head_dim 256, index heads 32 x 128, kpool 16, index_topk 2048 =
128 pools, page_size 64, bf16 caches, pages of each request scattered at random):

* indexer: `indexer_scores` (the kernel), `topk_lower_index_ties`, and the whole decode
  `indexer_select` path; bytes = pooled keys of every complete pool + q + w + the fp32 scores
  written. Against `ReferenceOps.indexer_select`: time and the number of requests whose
  selection differs (expected 0).
* sparse MLA: `sparse_mla_decode` (the kernel, split-K merge included) on the token lists the
  indexer selected (128 pools x 16 + the tail: up to 2063 latent rows per request); bytes =
  selected latent rows read once per request + token indices + q_abs + o_latent. And the
  whole op (q·W_kc, token lists, kernel, ·W_vc) against `ReferenceOps.sparse_mla` (which
  attends densely over the request's whole gathered latent with a mask): time, speed-up, and
  max |ours - reference| and ‖ours - reference‖/‖reference‖ (both bf16), plus each against an
  fp32 evaluation of the first requests (`truth ours/ref`: both ~bf16 rounding, ~4e-3).

Floors at full size (B=128, every request with 2063 selected rows): MLA reads 128 x 2063 x
1 KiB = 270 MB -> 66 us at 4.09 TB/s, and does 128 x 2063 x 64 x 512 x 4 = 34.6 GFLOP -> 44 us
at ~790 TFLOP/s bf16: 128 FLOP/B, just under the H200's ~193 FLOP/B ridge, so the kernel is
memory-bound only if its tensor-core work overlaps the loads. The indexer at 128K reads
128 x 8192 x 256 B = 268 MB -> 66 us (32 FLOP/B: memory-bound).

Bandwidth is reported against the measured H200 copy ceiling of 4.09 TB/s. Kernel times are
`triton.testing.do_bench` medians (L2 flushed between runs); reference times are the median
of 3 event-timed calls. A short table is printed last; with $OUT set, everything is also
written to $OUT/kernels_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TBPS, interpret_if_smoke, kernel_device, random_page_tables, write_out  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from bench.timing import timers  # noqa: E402

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import indexer as ix  # noqa: E402
from backends.kernels import sparse_mla as sm  # noqa: E402
from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402


FULL = dict(h=64, r=512, dn=256, dv=256, hi=32, di=128, kpool=16, topk=2048, page_size=64)
SMOKE = dict(h=4, r=32, dn=16, dv=16, hi=16, di=32, kpool=4, topk=16, page_size=16)

SWEEP_CONFIGS = [
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_H=64, BLOCK_N=16, num_warps=4, num_stages=3),
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
]
IDX_SWEEP_CONFIGS = [dict(BLOCK_P=p, num_warps=w, num_stages=1) for p in (32, 64, 128, 256) for w in (4, 8)]


# ---------------------------------------------------------------------------------------
def _meta(lens: list[int], page_size: int, dev: torch.device, g: torch.Generator):
    tables, num_pages = random_page_tables(lens, page_size, g)
    meta = BatchMeta.build([n - 1 for n in lens], [1] * len(lens), list(range(len(lens))), tables, page_size, dev)
    return meta, num_pages, tables


def _sub_problem(meta_tables, lens, page_size, cache, dev, n):
    """The first n requests with their pages copied into a compact fp32 cache (for the truth)."""
    pages = [p for t in meta_tables[:n] for p in t]
    sub_cache = cache[torch.tensor(pages, device=dev)].float()
    tables, c = [], 0
    for t in meta_tables[:n]:
        tables.append(list(range(c, c + len(t))))
        c += len(t)
    sub = BatchMeta.build([x - 1 for x in lens[:n]], [1] * n, list(range(n)), tables, page_size, dev)
    return sub, sub_cache


def _err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (out.float() - ref.float())
    return float(d.abs().max()), float(d.norm() / ref.float().norm())


def run_case(b: int, ctx: int, dims: dict, dev: torch.device, args, kernel_ms, ref_ms) -> dict:
    g = torch.Generator().manual_seed(args.seed * 1000 + b * 7 + ctx)
    gd = torch.Generator(device=dev).manual_seed(args.seed * 1000 + b * 7 + ctx)
    h, r, dn, dv, hi, di = dims["h"], dims["r"], dims["dn"], dims["dv"], dims["hi"], dims["di"]
    kpool, ps = dims["kpool"], dims["page_size"]
    topk_pools = dims["topk"] // kpool
    dt = torch.bfloat16
    scale = dn ** -0.5
    lens = [max(kpool, ctx - (i * 5) % kpool) for i in range(b)]  # tails of different lengths
    meta, num_pages, tables = _meta(lens, ps, dev, g)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device=dev, generator=gd) * s).to(dt)

    cache = rnd(num_pages, ps, r)
    pooled = rnd(num_pages, ps // kpool, di)
    q = rnd(b, h, dn)
    w_kc = rnd(h, dn, r, s=dn ** -0.5)
    w_vc = rnd(h, dv, r, s=r ** -0.5)
    qi = rnd(b, hi, di)
    wi = torch.randn(b, hi, device=dev, generator=gd) * hi ** -0.5
    row: dict = dict(batch=b, context=ctx, pages=num_pages, cache_gb=cache.numel() * 2 / 1e9)

    # ---- indexer ----
    n_pools = torch.div(meta.positions + 1, kpool, rounding_mode="floor")
    max_pools = max(n // kpool for n in lens)
    idx_cfg = dict(ix.default_config(hi, di))
    if args.idx_config:
        idx_cfg.update(args.idx_config)
    scores = ix.indexer_scores(qi, wi, pooled, meta.page_table, n_pools, ps // kpool, max_pools, config=idx_cfg)
    t_scores = kernel_ms(lambda: ix.indexer_scores(qi, wi, pooled, meta.page_table, n_pools, ps // kpool, max_pools,
                                                   out=scores, config=idx_cfg))
    t_topk = kernel_ms(lambda: ix.topk_lower_index_ties(scores, min(topk_pools, max_pools)))
    sel = ix.indexer_select(qi, wi, pooled, meta, kpool, topk_pools)
    t_select = kernel_ms(lambda: ix.indexer_select(qi, wi, pooled, meta, kpool, topk_pools))
    idx_bytes = (sum(n // kpool for n in lens) * di * 2 + b * hi * di * 2 + b * hi * 4 + b * max_pools * 4)
    row.update(idx_scores_us=t_scores * 1e3, idx_topk_us=t_topk * 1e3, idx_select_us=t_select * 1e3,
               idx_bytes=idx_bytes, idx_tbps=idx_bytes / (t_scores * 1e-3) / 1e12)
    row["idx_pct_ceiling"] = 100 * row["idx_tbps"] / CEILING_TBPS

    # ---- sparse MLA ----
    q_abs = torch.bmm(q.transpose(0, 1), w_kc).transpose(0, 1).contiguous()
    token_idx, ntok = sm.build_decode_token_idx(sel, meta, kpool, True)
    mla_cfg = dict(sm.default_config(h, r, dt))
    if args.mla_config:
        mla_cfg.update(args.mla_config)
    o_lat = torch.empty(b, h, r, dtype=dt, device=dev)
    sm.sparse_mla_decode(q_abs, cache, token_idx, scale, ntok, out=o_lat, config=mla_cfg)
    t_mla = kernel_ms(lambda: sm.sparse_mla_decode(q_abs, cache, token_idx, scale, ntok, out=o_lat, config=mla_cfg))
    t_build = kernel_ms(lambda: sm.build_decode_token_idx(sel, meta, kpool, True))
    n_rows = int(ntok.sum())
    mla_bytes = n_rows * r * 2 + token_idx.numel() * 4 + 2 * b * h * r * 2
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    splits = mla_cfg.get("num_splits") or sm.choose_num_splits(
        b, triton.cdiv(h, mla_cfg["BLOCK_H"]), token_idx.shape[1], mla_cfg["BLOCK_N"], sms)
    row.update(rows_per_req=n_rows / b, mla_us=t_mla * 1e3, mla_build_us=t_build * 1e3, mla_bytes=mla_bytes,
               mla_tbps=mla_bytes / (t_mla * 1e-3) / 1e12, mla_splits=splits, mla_config=mla_cfg)
    row["mla_pct_ceiling"] = 100 * row["mla_tbps"] / CEILING_TBPS
    row["mla_tflops"] = n_rows * h * r * 4 / (t_mla * 1e-3) / 1e12
    ops = CudaH200Ops()
    out = ops.sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, True)
    row["mla_op_us"] = kernel_ms(lambda: ops.sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, True)) * 1e3

    # ---- reference ----
    if not args.no_ref:
        ref = ReferenceOps()
        sel_ref = ref.indexer_select(qi, wi, pooled, meta, kpool, topk_pools)
        row["idx_ref_us"] = ref_ms(lambda: ref.indexer_select(qi, wi, pooled, meta, kpool, topk_pools)) * 1e3
        row["idx_speedup"] = row["idx_ref_us"] / row["idx_select_us"]
        row["idx_sel_mismatch_reqs"] = int((sel_ref != sel).any(dim=1).sum())
        o_ref = ref.sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, True)
        row["mla_ref_us"] = ref_ms(lambda: ref.sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, True)) * 1e3
        row["mla_speedup"] = row["mla_ref_us"] / row["mla_op_us"]
        row["mla_max_err"], row["mla_rel_err"] = _err(out, o_ref)
        n = min(b, args.truth_reqs)
        sub, sub_cache = _sub_problem(tables, lens, ps, cache, dev, n)
        truth = ref.sparse_mla(q[:n].float(), sub_cache, w_kc.float(), w_vc.float(), sel[:n], sub, kpool, scale, True)
        row["mla_truth_rel_ours"] = _err(out[:n], truth)[1]
        row["mla_truth_rel_ref"] = _err(o_ref[:n], truth)[1]
        del o_ref, truth, sub_cache
    del cache, pooled
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_sweep(dims: dict, dev: torch.device, args, kernel_ms) -> list[dict]:
    """The MLA kernel alone under several block shapes (same inputs per size)."""
    out = []
    h, r, kpool, ps = dims["h"], dims["r"], dims["kpool"], dims["page_size"]
    k = dims["topk"] + kpool - 1
    for b in args.sweep_batches:
        g = torch.Generator().manual_seed(b)
        gd = torch.Generator(device=dev).manual_seed(b)
        ctx = args.sweep_context
        meta, num_pages, _ = _meta([ctx] * b, ps, dev, g)
        cache = torch.randn(num_pages, ps, r, device=dev, generator=gd).bfloat16()
        q_abs = torch.randn(b, h, r, device=dev, generator=gd).bfloat16()
        token_idx = torch.randint(0, num_pages * ps, (b, k), device=dev, generator=gd, dtype=torch.int32)
        o = torch.empty(b, h, r, dtype=torch.bfloat16, device=dev)
        nbytes = b * k * r * 2 + b * k * 4 + 2 * b * h * r * 2
        for cfg in SWEEP_CONFIGS:
            for splits in (None, 1, 2, 4, 8, 16, 32):
                if splits is not None and b * splits > 4 * 132:
                    continue
                rec = dict(kernel="mla", batch=b, context=ctx, num_splits=splits or "auto", **cfg)
                try:
                    sm.sparse_mla_decode(q_abs, cache, token_idx, 1 / 16, out=o, config=cfg, num_splits=splits)
                    t = kernel_ms(lambda: sm.sparse_mla_decode(q_abs, cache, token_idx, 1 / 16, out=o, config=cfg,
                                                               num_splits=splits))
                    rec.update(us=t * 1e3, tbps=nbytes / (t * 1e-3) / 1e12)
                except Exception as e:  # a shape that does not compile (resources) is a result too
                    rec.update(error=f"{type(e).__name__}: {str(e)[:160]}")
                out.append(rec)
                print("sweep", rec, flush=True)
        del cache
        # the indexer scoring kernel at the same batch, 128K context
        ctx_i = args.sweep_context * 4
        meta, num_pages, _ = _meta([ctx_i] * b, ps, dev, g)
        pooled = torch.randn(num_pages, ps // kpool, dims["di"], device=dev, generator=gd).bfloat16()
        qi = torch.randn(b, dims["hi"], dims["di"], device=dev, generator=gd).bfloat16()
        wi = torch.randn(b, dims["hi"], device=dev, generator=gd)
        n_pools = torch.div(meta.positions + 1, kpool, rounding_mode="floor")
        max_pools = ctx_i // kpool
        scores = torch.empty(b, max_pools, device=dev)
        nbytes = b * max_pools * (dims["di"] * 2 + 4) + b * dims["hi"] * (dims["di"] * 2 + 4)
        for cfg in IDX_SWEEP_CONFIGS:
            rec = dict(kernel="indexer", batch=b, context=ctx_i, **cfg)
            try:
                fn = lambda: ix.indexer_scores(qi, wi, pooled, meta.page_table, n_pools, ps // kpool,  # noqa: E731
                                               max_pools, out=scores, config=cfg)
                fn()
                t = kernel_ms(fn)
                rec.update(us=t * 1e3, tbps=nbytes / (t * 1e-3) / 1e12)
            except Exception as e:
                rec.update(error=f"{type(e).__name__}: {str(e)[:160]}")
            out.append(rec)
            print("sweep", rec, flush=True)
        del pooled
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _kv(s: str) -> dict:
    out = {}
    for part in filter(None, s.split(",")):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ref", action="store_true", help="skip the ReferenceOps comparison")
    p.add_argument("--truth-reqs", type=int, default=2, help="requests checked against fp32")
    p.add_argument("--mla-config", type=_kv, default=None, help="e.g. BLOCK_H=64,BLOCK_N=32,num_warps=8,num_stages=2")
    p.add_argument("--idx-config", type=_kv, default=None, help="e.g. BLOCK_P=128,num_warps=4,num_stages=1")
    p.add_argument("--sweep", action="store_true", help="also sweep MLA block shapes and split counts")
    p.add_argument("--sweep-batches", default="1,16,128")
    p.add_argument("--sweep-context", type=int, default=32768)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    args = p.parse_args(argv)
    args.sweep_batches = [int(x) for x in args.sweep_batches.split(",")]

    dev = kernel_device()
    if dev is None:
        return 2
    dims = SMOKE if args.smoke else FULL
    batches = [1, 3] if args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [64, 203] if args.smoke else [int(x) for x in args.contexts.split(",")]
    if args.smoke:
        args.sweep_batches, args.sweep_context = [2], 64
    kernel_ms, ref_ms = timers(dev)
    env = dict(torch=torch.__version__, triton=triton.__version__, device=str(dev),
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
               dims=dims, ceiling_tbps=CEILING_TBPS)
    print("env", env, flush=True)

    rows = []
    for ctx in contexts:
        for b in batches:
            t0 = time.time()
            row = run_case(b, ctx, dims, dev, args, kernel_ms, ref_ms)
            row["wall_s"] = time.time() - t0
            rows.append(row)
            print("case", json.dumps(row, default=str), flush=True)
    sweep = run_sweep(dims, dev, args, kernel_ms) if args.sweep and (dev.type == "cuda" or args.smoke) else []

    write_out("kernels_h200.json", dict(env=env, rows=rows, sweep=sweep))

    if sweep:
        print(f"\nsweep (best per batch; MLA at {args.sweep_context} ctx, indexer at {4 * args.sweep_context}):")
        for b in args.sweep_batches:
            for kind, n in (("mla", 5), ("indexer", 3)):
                ok = sorted((x for x in sweep if x["kernel"] == kind and x["batch"] == b and "us" in x),
                            key=lambda x: x["us"])[:n]
                for x in ok:
                    shape = (f"H{x['BLOCK_H']} N{x['BLOCK_N']} w{x['num_warps']} s{x['num_stages']} "
                             f"splits={x['num_splits']}" if kind == "mla" else f"P{x['BLOCK_P']} w{x['num_warps']}")
                    print(f"  {kind:<7} B={b:<4} {shape:<34} {x['us']:8.1f} us {x['tbps']:5.2f} TB/s")
    na = float("nan")
    print(f"\nsparse MLA decode (H {dims['h']}, R {dims['r']}, bf16; TB/s vs {CEILING_TBPS} ceiling; "
          "op = q·W_kc + token lists + kernel + ·W_vc)")
    print(f"{'B':>4} {'ctx':>7} {'rows/req':>8} {'split':>5} {'kern us':>8} {'TB/s':>5} {'%ceil':>5} "
          f"{'op us':>8} {'ref us':>9} {'speedup':>7} {'maxerr':>7} {'relerr':>7} {'truth ours/ref':>15}")
    for x in rows:
        print(f"{x['batch']:>4} {x['context']:>7} {x['rows_per_req']:>8.0f} {x['mla_splits']:>5} {x['mla_us']:>8.1f} "
              f"{x['mla_tbps']:>5.2f} {x['mla_pct_ceiling']:>5.1f} {x['mla_op_us']:>8.1f} "
              f"{x.get('mla_ref_us', na):>9.0f} {x.get('mla_speedup', na):>7.1f} {x.get('mla_max_err', na):>7.4f} "
              f"{x.get('mla_rel_err', na):>7.4f} "
              f"{x.get('mla_truth_rel_ours', na):>7.4f}/{x.get('mla_truth_rel_ref', na):<7.4f}")
    print(f"\nDSA indexer decode (Hi {dims['hi']}, di {dims['di']}, kpool {dims['kpool']}, top {dims['topk']} tokens; "
          "TB/s of the scoring kernel)")
    print(f"{'B':>4} {'ctx':>7} {'score us':>8} {'TB/s':>5} {'%ceil':>5} {'topk us':>7} {'select us':>9} "
          f"{'ref us':>9} {'speedup':>7} {'sel diff':>8}")
    for x in rows:
        print(f"{x['batch']:>4} {x['context']:>7} {x['idx_scores_us']:>8.1f} {x['idx_tbps']:>5.2f} "
              f"{x['idx_pct_ceiling']:>5.1f} {x['idx_topk_us']:>7.1f} {x['idx_select_us']:>9.1f} "
              f"{x.get('idx_ref_us', na):>9.0f} {x.get('idx_speedup', na):>7.1f} "
              f"{x.get('idx_sel_mismatch_reqs', -1):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
