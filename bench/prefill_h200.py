"""Prefill on the cuda-h200 kernels: DSA indexer selection and sparse MLA, one row per token.

    python3 -m bench.prefill_h200                 # full size on a GPU (torch + triton only)
    python3 -m bench.prefill_h200 --smoke         # tiny sizes; CPU-only: Triton's interpreter

Cases (prefix 0, pages scattered at random, bf16 everywhere): one request of 16K tokens, and
4 requests of 4K, at full flash shapes (H 64, kv_lora_rank R 512, dn = dv = 256, index heads
32 x 128, kpool 16, topk 128 pools, page_size 64). Every query token is a kernel row with its
own position and selection (backends/kernels/{indexer,sparse_mla}.py):

* indexer: `indexer_select` (scores kernel over each token's complete pools + tie-broken
  top-k per row) vs `ReferenceOps.indexer_select`; useful FLOPs = Σ_tokens visible pools x
  Hi x di x 2 (the kernel also runs the masked blocks up to the longest request's pools).
  `sel diff` = rows whose selection differs from the reference (expected 0; bf16 keys can
  flip a near-tie, the reference sums in a different order).
* sparse MLA: the kernel alone on q_abs (absorbed form: 4 x H x R FLOPs per (token, selected
  latent row)) and the whole op (q·W_kc, kernel, ·W_vc: + 4 x H x R x 256 per token) vs
  `ReferenceOps.sparse_mla` (expands K/V per request and attends densely with a mask). The
  reference's [H, S, T] scores do not fit at 16K, so it runs on query chunks of --ref-chunk
  tokens (a request with prefix s and seq c is the same rows) and the times are summed.

TFLOP/s are against the H200's 779 dense bf16 TFLOP/s. With $OUT set, the rows are also
written to $OUT/prefill_h200.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TFLOPS as PEAK_TFLOPS, interpret_if_smoke, kernel_device, random_page_tables, write_out  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import indexer as ix  # noqa: E402
from backends.kernels import sparse_mla as sm  # noqa: E402
from backends.kernels import sparse_mla_rows  # noqa: E402
from backends.kernels import sparse_mla_sm90 as sm90  # noqa: E402
from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from bench.timing import timers  # noqa: E402


FULL = dict(h=64, r=512, dn=256, dv=256, hi=32, di=128, kpool=16, topk_pools=128, page_size=64)
SMOKE = dict(h=4, r=32, dn=16, dv=16, hi=16, di=32, kpool=4, topk_pools=4, page_size=16)
FULL_CASES = [[16384], [4096] * 4]
SMOKE_CASES = [[96], [40] * 3]


def _meta(prefix: list[int], seq: list[int], tables, page_size, dev):
    return BatchMeta.build(prefix, seq, list(range(len(seq))), tables, page_size, dev)


def _ref_chunked(fn, lens, tables, page_size, dev, chunk, ref_ms):
    """Run `fn(meta, s0, s1)` over query chunks of every request (prefix s, seq c); returns the
    concatenated outputs and the summed time."""
    outs, total_ms, base = [], 0.0, 0
    for r, n in enumerate(lens):
        for s in range(0, n, chunk):
            c = min(chunk, n - s)
            meta = _meta([s], [c], [tables[r]], page_size, dev)
            res = {}
            total_ms += ref_ms(lambda: res.__setitem__("o", fn(meta, base + s, base + s + c)), n=1)
            outs.append(res["o"])
        base += n
    return torch.cat(outs), total_ms


def run_case(lens: list[int], d: dict, dev: torch.device, args, kernel_ms, ref_ms) -> dict:
    g = torch.Generator().manual_seed(args.seed * 1000 + sum(lens) + len(lens))
    ps, kpool, topk = d["page_size"], d["kpool"], d["topk_pools"]
    tables, num_pages = random_page_tables(lens, ps, g)
    meta = _meta([0] * len(lens), lens, tables, ps, dev)
    n = meta.num_tokens
    bf = torch.bfloat16

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dev, bf)

    pooled = rnd(num_pages, ps // kpool, d["di"])
    qi = rnd(n, d["hi"], d["di"])
    wi = (torch.randn(n, d["hi"], generator=g) * d["hi"] ** -0.5).to(dev)
    cache = rnd(num_pages, ps, d["r"])
    q = rnd(n, d["h"], d["dn"])
    w_kc = rnd(d["h"], d["dn"], d["r"], s=d["dn"] ** -0.5)
    w_vc = rnd(d["h"], d["dv"], d["r"], s=d["r"] ** -0.5)
    scale = d["dn"] ** -0.5
    ops = CudaH200Ops()
    ops.prefill_kernels = True  # the per-token prefill kernels (--dsa-prefill-backend triton)

    # ---- indexer -----------------------------------------------------------------------
    vis = ((meta.positions + 1) // kpool).double()
    idx_flop = float(vis.sum()) * d["hi"] * d["di"] * 2
    sel = ix.indexer_select(qi, wi, pooled, meta, kpool, topk)
    idx_ms = kernel_ms(lambda: ix.indexer_select(qi, wi, pooled, meta, kpool, topk))
    row = dict(lens=lens, tokens=n, idx_us=idx_ms * 1e3, idx_tflops=idx_flop / idx_ms / 1e9)
    row["idx_pct_peak"] = 100 * row["idx_tflops"] / PEAK_TFLOPS

    # ---- sparse MLA --------------------------------------------------------------------
    pos = meta.positions.double()
    complete = torch.floor((pos + 1) / kpool)
    n_sel = (sel >= 0).sum(1).double()  # the indexer picks only complete pools
    rows_per_tok = n_sel * kpool + (pos + 1 - complete * kpool)  # + the visible tail
    attn_flop = float(rows_per_tok.sum()) * d["h"] * d["r"] * 4
    proj_flop = n * d["h"] * d["r"] * (d["dn"] + d["dv"]) * 2
    q_abs = torch.bmm(q.transpose(0, 1), w_kc).transpose(0, 1).contiguous()
    table = meta.page_table.contiguous()
    kern = lambda: sm.sparse_mla_rows_sel(q_abs, cache, sel, meta.positions, meta.req_index, table, ps,  # noqa: E731
                                          kpool, scale, True, config=args.mla_config)
    mla_ms = kernel_ms(kern)
    op = lambda: ops.sparse_mla(q, cache, w_kc, w_vc, sel, meta, kpool, scale, True)  # noqa: E731
    out = op()
    op_ms = kernel_ms(op)
    row.update(rows_per_token=float(rows_per_tok.mean()), mla_us=mla_ms * 1e3,
               mla_tflops=attn_flop / mla_ms / 1e9, mla_op_us=op_ms * 1e3,
               mla_op_tflops=(attn_flop + proj_flop) / op_ms / 1e9)
    row["mla_pct_peak"] = 100 * row["mla_tflops"] / PEAK_TFLOPS
    row["mla_op_pct_peak"] = 100 * row["mla_op_tflops"] / PEAK_TFLOPS

    if not args.no_ref:
        ref = ReferenceOps()
        ref_sel = ref.indexer_select(qi, wi, pooled, meta, kpool, topk)
        row["idx_ref_us"] = ref_ms(lambda: ref.indexer_select(qi, wi, pooled, meta, kpool, topk)) * 1e3
        row["idx_speedup"] = row["idx_ref_us"] / row["idx_us"]
        row["idx_sel_diff_rows"] = int((sel != ref_sel).any(1).sum())
        ref_out, ref_t = _ref_chunked(
            lambda m, s0, s1: ref.sparse_mla(q[s0:s1], cache, w_kc, w_vc, sel[s0:s1], m, kpool, scale, True),
            lens, tables, ps, dev, args.ref_chunk, ref_ms)
        row["mla_ref_us"] = ref_t * 1e3
        row["mla_speedup"] = row["mla_ref_us"] / row["mla_op_us"]
        diff = (out.float() - ref_out.float())
        row["mla_max_err"] = float(diff.abs().max())
        row["mla_rel_err"] = float(diff.norm() / ref_out.float().norm())
    return row


def mla_sweep(lens: list[int], d: dict, dev: torch.device, args, kernel_ms) -> int:
    """The sparse-MLA prefill kernel alone under each config of --mla-sweep (same inputs,
    outputs checked against the first config's)."""
    g = torch.Generator().manual_seed(args.seed)
    ps, kpool = d["page_size"], d["kpool"]
    tables, num_pages = random_page_tables(lens, ps, g)
    meta = _meta([0] * len(lens), lens, tables, ps, dev)
    n, bf = meta.num_tokens, torch.bfloat16
    pooled = torch.randn(num_pages, ps // kpool, d["di"], generator=g).to(dev, bf)
    qi = torch.randn(n, d["hi"], d["di"], generator=g).to(dev, bf)
    wi = (torch.randn(n, d["hi"], generator=g) * d["hi"] ** -0.5).to(dev)
    sel = ix.indexer_select(qi, wi, pooled, meta, kpool, d["topk_pools"])
    cache = torch.randn(num_pages, ps, d["r"], generator=g).to(dev, bf)
    q_abs = (torch.randn(n, d["h"], d["r"], generator=g) * d["r"] ** -0.25).to(dev, bf)
    pos = meta.positions.double()
    complete = torch.floor((pos + 1) / kpool)
    rows = float(((sel >= 0).sum(1).double() * kpool + (pos + 1 - complete * kpool)).sum())
    flop = rows * d["h"] * d["r"] * 4
    table, first, out = meta.page_table.contiguous(), None, []
    lists = lambda: sm.build_prefill_token_idx(sel, meta.positions, meta.req_index, table, ps, kpool, True)  # noqa: E731
    token_idx, ntok = lists()
    list_ms = kernel_ms(lists)
    # the same set built by torch ops (what the lists took before their one-launch kernel)
    torch_lists = lambda: sparse_mla_rows._token_rows(sel, meta.positions, table[meta.req_index], ps, kpool, True, 0)  # noqa: E731
    print("config", json.dumps(dict(build_prefill_token_idx_ms=list_ms, torch_ops_token_rows_ms=kernel_ms(torch_lists))),
          flush=True)
    for spec in (x.strip() for x in args.mla_sweep.split(";") if x.strip()):
        hopper = spec.split(",")[0] == "kernel=sm90"
        try:  # a config that does not parse, compile or fit: say so, go on
            if hopper:  # the Hopper kernel (two warpgroups splitting the tiles) on the packed lists
                flat, o_sm90 = cache.view(-1, d["r"]), torch.empty_like(q_abs)
                hcfg = _kv(spec[len("kernel=sm90,"):]) if "," in spec else {}
                kern = lambda: sm90.sparse_mla_rows_sm90(q_abs, flat, token_idx, ntok, d["r"] ** -0.5, o_sm90,  # noqa: E731
                                                         hcfg)
            elif "list=precomputed" in spec:  # the kernel on the packed row lists (what it reads at decode)
                cfg = _kv(spec.replace(",list=precomputed", ""))
                kern = lambda: sm.sparse_mla_decode(q_abs, cache, token_idx, d["r"] ** -0.5, ntok, config=cfg)  # noqa: E731
            else:
                cfg = _kv(spec)
                kern = lambda: sm.sparse_mla_rows_sel(q_abs, cache, sel, meta.positions, meta.req_index,  # noqa: E731
                                                      table, ps, kpool, d["r"] ** -0.5, True, config=cfg)
            o = kern().float()
            ms = kernel_ms(kern)
        except Exception as e:
            print("config", spec, "failed:", str(e).splitlines()[0][:160], flush=True)
            continue
        ck = sm._LAST_COMPILED.get("attention") if not hopper else None
        regs, spills = getattr(ck, "n_regs", -1), getattr(ck, "n_spills", -1)
        first = o if first is None else first
        rel = float((o - first).norm() / first.norm())
        out.append((spec, ms, flop / ms / 1e9, rel, regs, spills))
        print("config", json.dumps(dict(config=spec, ms=ms, tflops=out[-1][2], rel_vs_first=rel, regs=regs,
                                        spills=spills)), flush=True)
    print(f"\nsparse-MLA prefill kernel, {len(lens)}x{lens[0]} tokens, {rows / n:.0f} rows/token (TFLOP/s vs "
          f"{PEAK_TFLOPS:.0f}); the packed row lists take {list_ms:.2f} ms to build")
    for spec, ms, tf, rel, regs, spills in out:
        print(f"{spec:>64} {ms:>9.2f} ms {tf:>6.1f} TF/s {100 * tf / PEAK_TFLOPS:>5.1f}% rel {rel:.1e} "
              f"regs {regs} spills {spills}")
    return 0


def _kv(s: str) -> dict:
    out = {}
    for part in s.split(","):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ref", action="store_true", help="skip the ReferenceOps comparison")
    p.add_argument("--ref-chunk", type=int, default=1024, help="query tokens per reference call")
    p.add_argument("--mla-config", type=_kv, default=None, help="e.g. BLOCK_H=64,BLOCK_N=32,num_warps=8,num_stages=2")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    p.add_argument("--mla-sweep", default="", help="';'-separated --mla-config values: time only the "
                   "sparse-MLA kernel of the first case under each, side by side ('kernel=sm90[,BLOCK_N=..,STAGES=..]': the Hopper kernel)")
    args = p.parse_args(argv)

    dev = kernel_device()
    if dev is None:
        return 2
    d = SMOKE if args.smoke else FULL
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    if args.smoke:
        args.ref_chunk = min(args.ref_chunk, 32)
    kernel_ms, ref_ms = timers(dev)
    env = dict(torch=torch.__version__, triton=triton.__version__, device=str(dev),
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)", dims=d,
               peak_tflops=PEAK_TFLOPS)
    print("env", env, flush=True)
    if args.mla_sweep:
        return mla_sweep(cases[0], d, dev, args, kernel_ms)
    rows = []
    for lens in cases:
        t0 = time.time()
        row = run_case(lens, d, dev, args, kernel_ms, ref_ms)
        row["wall_s"] = time.time() - t0
        rows.append(row)
        print("case", json.dumps(row), flush=True)

    write_out("prefill_h200.json", dict(env=env, rows=rows))

    na = float("nan")
    print(f"\nprefill, one kernel row per token (H {d['h']}, R {d['r']}, Hi {d['hi']} x {d['di']}, kpool {d['kpool']}, "
          f"top {d['topk_pools']} pools; TFLOP/s vs {PEAK_TFLOPS:.0f})")
    print(f"{'requests':>12} {'idx us':>9} {'TF/s':>6} {'ref us':>10} {'x':>6} {'diff':>5} | "
          f"{'rows/tok':>8} {'mla us':>9} {'TF/s':>6} {'%peak':>5} {'op us':>9} {'TF/s':>6} {'ref us':>10} "
          f"{'x':>6} {'relerr':>7}")
    for x in rows:
        name = f"{len(x['lens'])}x{x['lens'][0]}"
        print(f"{name:>12} {x['idx_us']:>9.0f} {x['idx_tflops']:>6.1f} {x.get('idx_ref_us', na):>10.0f} "
              f"{x.get('idx_speedup', na):>6.1f} {x.get('idx_sel_diff_rows', -1):>5} | "
              f"{x['rows_per_token']:>8.0f} {x['mla_us']:>9.0f} {x['mla_tflops']:>6.1f} {x['mla_pct_peak']:>5.1f} "
              f"{x['mla_op_us']:>9.0f} {x['mla_op_tflops']:>6.1f} {x.get('mla_ref_us', na):>10.0f} "
              f"{x.get('mla_speedup', na):>6.1f} {x.get('mla_rel_err', na):>7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
