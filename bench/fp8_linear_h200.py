"""The dense FP8 (w8a16) linear of the cuda-h200 backend on the GPU: correctness, then speed.

    python3 -m bench.fp8_linear_h200             # H200: flash projection shapes, N = 1, 16, 64, 128
    python3 -m bench.fp8_linear_h200 --sweep     # + tiles / split-K alternatives at decode sizes
    python3 -m bench.fp8_linear_h200 --smoke     # tiny sizes; on a CPU-only machine it runs the
                                                 # kernels in Triton's interpreter

Shapes: every dense projection of a flash-4l layer (glmrt/checkpoint/presets.py; hidden 4096):
DSA attention q_a / q_b / kv_a / kv_b / o, indexer wq_b / wk, KDA q,k,v / f_a,g_a / f_b,g_b /
b / o, the shared expert gate,up / down, and lm_head (which real FP8 checkpoints keep in bf16:
the largest matrix, here for scale). fp8 e4m3 weights with 128x128 block scales against the same
shape in bf16 through torch F.linear (cuBLAS).

1. Correctness per shape at N = 1 and 64: `fp8_linear` (output NaN-poisoned first) against
   ReferenceOps.linear (dequantise to bf16 + F.linear) and both against an fp32 product of the
   same bf16-rounded weight; the bound for bf16 operands: ‖out − ref‖/‖ref‖ < 1e-2.
   Also: no host sync (torch.cuda.set_sync_debug_mode("error")) on a split-K and an unsplit
   shape, and a CUDA graph replayed on a new x equals eager.
2. Timing: (a) `triton.testing.do_bench` median, L2 flushed before every call (cold weights,
   launch overhead included); (b) a CUDA graph of one call per weight copy, rotating over enough
   copies (>= 160 MB of fp8 weights, at most 512 copies) that the weights come from HBM, replayed
   and timed with events: per-call time without launch gaps, as a captured decode step runs it.
   Bytes = weight (+ scales) + x read + y written; GB/s against the measured 4.09 TB/s copy
   ceiling (bench/h200.py). The bf16 F.linear is timed the same way; `ratio` = fp8 time / bf16 time
   (the ideal at decode is ~0.5: half the weight bytes). Prefill: a few shapes at N = 4096
   (do_bench only) in TFLOP/s against bf16 F.linear.

A short table is printed last; with $OUT set, everything also goes to $OUT/fp8_linear_h200.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TBPS, CEILING_TFLOPS, interpret_if_smoke, kernel_device, write_out  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import fp8_linear as f8  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from backends.fp8_numerics import dequantize_block_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
ROTATE_BYTES = 160e6    # fp8 weight bytes cycled through in the graph timing (H200 L2: 50 MB)
MAX_COPIES = 512


def flash_shapes() -> list[tuple[str, int, int]]:
    """(name, in, out) of the dense projections of flash-4l, equal shapes merged."""
    from glmrt.checkpoint.presets import preset_config

    t = preset_config("flash-4l").text
    d, h = t.hidden_size, t.num_attention_heads
    qk = t.qk_nope_head_dim + t.qk_rope_head_dim
    qkv = t.linear_num_heads * t.linear_head_dim
    shared = t.moe_intermediate_size * t.n_shared_experts
    raw = [
        ("dsa.q_a", d, t.q_lora_rank), ("dsa.q_b", t.q_lora_rank, h * qk),
        ("dsa.kv_a", d, t.kv_lora_rank + t.qk_rope_head_dim),
        ("dsa.kv_b", t.kv_lora_rank, h * (t.qk_nope_head_dim + t.v_head_dim)),
        ("dsa.o", h * t.v_head_dim, d),
        ("idx.wq_b", t.q_lora_rank, t.index_n_heads * t.index_head_dim), ("idx.wk", d, t.index_head_dim),
        ("kda.q,k,v", d, qkv), ("kda.f_a,g_a", d, t.linear_head_dim), ("kda.f_b,g_b", t.linear_head_dim, qkv),
        ("kda.b", d, t.linear_num_heads), ("kda.o", qkv, d),
        ("shexp.gate,up", d, shared), ("shexp.down", shared, d),
        ("lm_head(bf16 in ckpt)", d, t.vocab_size),
        # the LinearGroups a decode step runs as one product
        ("kda.in_proj(q,k,v,f_a,g_a,b)", d, 3 * qkv + 2 * t.linear_head_dim + t.linear_num_heads),
        ("dsa.in_proj(q_a,kv_a)", d, t.q_lora_rank + t.kv_lora_rank + t.qk_rope_head_dim),
    ]
    merged: dict[tuple[int, int], str] = {}
    for name, i, o in raw:
        merged[(i, o)] = merged[(i, o)] + "|" + name if (i, o) in merged else name
    return [(name, i, o) for (i, o), name in merged.items()]


SMOKE_SHAPES = [("smoke.a", 256, 192), ("smoke.b", 320, 72), ("smoke.c", 128, 520)]
PREFILL_SHAPES = ("dsa.q_b", "kda.q,k,v", "dsa.o")

SWEEP_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
                 for bm in (16, 64) for bn in (32, 64, 128) for w, s in ((4, 3), (4, 5), (8, 4))]


# ---------------------------------------------------------------------------------------
def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def make_weight(in_f: int, out_f: int, dev, gd, copies: int):
    """`copies` fp8 weights (e4m3 ~N(0,1), scales ~in^-0.5) and bf16 weights of the same size."""
    fp8, bf16 = [], []
    for _ in range(copies):
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=gd).to(FP8)
        s = torch.rand(triton.cdiv(out_f, BLOCK[0]), triton.cdiv(in_f, BLOCK[1]), device=dev,
                       generator=gd).add_(0.5).mul_(in_f ** -0.5)
        fp8.append((w, s))
        bf16.append(torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=gd).mul_(in_f ** -0.5))
    return fp8, bf16


def check_shape(name, in_f, out_f, w, s, dev, gd, tokens=(1, 64)) -> list[dict]:
    ref_ops = ReferenceOps()
    rows = []
    for n in tokens:
        x = torch.randn(n, in_f, device=dev, dtype=torch.bfloat16, generator=gd)
        out = torch.full((n, out_f), float("nan"), device=dev, dtype=torch.bfloat16)
        f8.fp8_linear(x, w, s, BLOCK, None, out=out)
        again = f8.fp8_linear(x, w, s, BLOCK)
        ref = ref_ops.linear(x, w, None, s, BLOCK)
        wq = dequantize_block_fp8(w, s, BLOCK, torch.bfloat16)
        truth = x.float() @ wq.float().T
        row = dict(check=name, tokens=n, in_f=in_f, out_f=out_f, nan=bool(torch.isnan(out).any()),
                   deterministic=bool(torch.equal(out, again)), rel_vs_ref=_rel(out, ref),
                   rel_ours_truth=_rel(out, truth), rel_ref_truth=_rel(ref, truth),
                   splits=f8.split_k(n, out_f, in_f, f8.get_config(n, act_fp8=ACT_FP8[0]), f8.sm_count(x.device))[0])
        row["pass"] = (not row["nan"] and row["deterministic"] and row["rel_vs_ref"] < 1e-2
                       and row["rel_ours_truth"] < 1e-2)
        rows.append(row)
        print("check", json.dumps(row), flush=True)
    return rows


def check_graph_and_sync(dev, gd) -> list[dict]:
    """No host sync, and graph replay == eager, on a split-K shape and an unsplit one."""
    ops = CudaH200Ops()
    res = []
    for in_f, out_f, n in ((4096, 512, 1), (4096, 512, 16), (1536, 16384, 1)):
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16, generator=gd).to(FP8)
        s = torch.rand(triton.cdiv(out_f, 128), triton.cdiv(in_f, 128), device=dev, generator=gd) * in_f ** -0.5
        b = torch.randn(out_f, device=dev, dtype=torch.bfloat16, generator=gd)
        x = torch.randn(n, in_f, device=dev, dtype=torch.bfloat16, generator=gd)
        r: dict = dict(check="graph+sync", in_f=in_f, out_f=out_f, tokens=n,
                       splits=f8.split_k(n, out_f, in_f, f8.get_config(n, act_fp8=ACT_FP8[0]), f8.sm_count(dev))[0])
        eager = ops.linear(x, w, b, s, BLOCK)
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            ops.linear(x, w, b, s, BLOCK)
            r["no_host_sync"] = True
        except RuntimeError as err:
            r["no_host_sync"] = False
            r["sync_error"] = str(err)[:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = ops.linear(x, w, b, s, BLOCK)
            x.copy_(torch.randn(x.shape, device=dev, generator=gd, dtype=x.dtype))
            graph.replay()
            torch.cuda.synchronize()
            r["graph_equal_eager"] = bool(torch.equal(static, ops.linear(x, w, b, s, BLOCK)))
            r["graph_saw_new_x"] = not bool(torch.equal(static, eager))
        except Exception as err:  # noqa: BLE001 - a failed capture is a result
            r["graph_equal_eager"] = False
            r["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        r["pass"] = r["no_host_sync"] and r["graph_equal_eager"] and r.get("graph_saw_new_x", False)
        print("check", json.dumps(r), flush=True)
        res.append(r)
    return res


# ---------------------------------------------------------------------------------------
def _bench_ms(fn, dev) -> float:
    if dev.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _graph_ms(calls, dev, replays: int = 5) -> float | None:
    """Per-call ms of a CUDA graph holding `calls` (rotating weight copies), median replay."""
    if dev.type != "cuda":
        return None
    for c in calls:  # compile / warm outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    del graph
    times.sort()
    return times[len(times) // 2]


ACT_FP8 = [False]  # --act dynamic: w8a8 (activations quantised on the fly)


def time_shape(name, in_f, out_f, fp8_ws, bf16_ws, n, dev, gd, config=None, splits=None) -> dict:
    x = torch.randn(n, in_f, device=dev, dtype=torch.bfloat16, generator=gd)
    y8 = torch.empty(n, out_f, device=dev, dtype=torch.bfloat16)
    yb = torch.empty(n, out_f, device=dev, dtype=torch.bfloat16)
    io = 2 * n * (in_f + out_f)
    b8 = out_f * in_f + fp8_ws[0][1].numel() * 4 + io
    bb = 2 * out_f * in_f + io
    flops = 2.0 * n * in_f * out_f
    cfg = f8.get_config(n, act_fp8=ACT_FP8[0])
    if config:
        cfg.update(config)
    sp, _ = f8.split_k(n, out_f, in_f, cfg, f8.sm_count(dev)) if splits is None else (splits, None)

    def k8(j):
        w, s = fp8_ws[j]
        return lambda: f8.fp8_linear(x, w, s, BLOCK, out=y8, config=config, splits=splits, act_fp8=ACT_FP8[0])

    def kb(j):
        return lambda: torch.matmul(x, bf16_ws[j].T, out=yb)  # F.linear's cuBLAS GEMM, into y

    row = dict(shape=name, in_f=in_f, out_f=out_f, tokens=n, splits=sp, cfg=cfg,
               mb_fp8=b8 / 1e6, mb_bf16=bb / 1e6)
    row["ms"] = _bench_ms(k8(0), dev)
    row["bf16_ms"] = _bench_ms(kb(0), dev)
    row["g_ms"] = _graph_ms([k8(j) for j in range(len(fp8_ws))], dev)
    row["bf16_g_ms"] = _graph_ms([kb(j) for j in range(len(bf16_ws))], dev)
    for key, nbytes in (("ms", b8), ("bf16_ms", bb), ("g_ms", b8), ("bf16_g_ms", bb)):
        if row[key]:
            row[key.replace("ms", "gbps")] = nbytes / (row[key] * 1e-3) / 1e9
    t = row["g_ms"] or row["ms"]
    tb = row["bf16_g_ms"] or row["bf16_ms"]
    row["pct_bw"] = 100 * b8 / (t * 1e-3) / (CEILING_TBPS * 1e12)
    row["ratio"] = t / tb
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    row["bf16_tflops"] = flops / (row["bf16_ms"] * 1e-3) / 1e12
    row["floor_us"] = max(b8 / (CEILING_TBPS * 1e12), flops / (CEILING_TFLOPS * 1e12)) * 1e6
    print("case", json.dumps(row, default=str), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,64,128")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="0: skip the prefill rows")
    p.add_argument("--shapes", default="", help="comma list of shape-name substrings (default: all)")
    p.add_argument("--sweep", action="store_true", help="tiles / splits alternatives at decode sizes")
    p.add_argument("--sweep-tokens", default="1,16,128")
    p.add_argument("--sweep-tiles", default="",
                   help="BLOCK_MxBLOCK_NxWARPSxSTAGES[s],... instead of SWEEP_CONFIGS (e.g. 64x32x4x4,16x128x8x3s; "
                        "a trailing s: swapped tiles, the weight rows on the MMA's M side, w8a8 only)")
    p.add_argument("--cublas-min-rows", type=int, default=None,
                   help="fp8_linear.CUBLAS_MIN_ROWS (w8a8 on cuBLASLt's block-scaled GEMM from N rows; huge: Triton)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--act", default="none", help="none: w8a16 (x stays bf16); dynamic: w8a8 (x quantised)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    args = p.parse_args(argv)
    ACT_FP8[0] = args.act == "dynamic"
    if args.cublas_min_rows is not None:
        f8.CUBLAS_MIN_ROWS = args.cublas_min_rows
    sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")]
    sweep_configs = SWEEP_CONFIGS if not args.sweep_tiles else [
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=st, SWAP_AB=t.endswith("s"))
        for t in args.sweep_tiles.split(",") for bm, bn, w, st in [map(int, t.rstrip("s").split("x"))]]

    t_start = time.time()
    dev = kernel_device()
    if dev is None:
        return 2
    shapes = SMOKE_SHAPES if args.smoke else flash_shapes()
    if args.shapes:
        keys = args.shapes.split(",")
        shapes = [s for s in shapes if any(k in s[0] for k in keys)]
    tokens = [1, 3] if args.smoke else [int(t) for t in args.tokens.split(",")]
    env = dict(torch=torch.__version__, triton=triton.__version__, device=str(dev),
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
               sms=f8.sm_count(dev), ceiling_tbps=CEILING_TBPS, ceiling_tflops=CEILING_TFLOPS,
               configs=f8.CONFIGS, split_min_waves=f8.SPLIT_MIN_WAVES, split_ws_ratio=f8.SPLIT_WS_RATIO)
    print("env", json.dumps(env, default=str), flush=True)
    gd = torch.Generator(device=dev).manual_seed(args.seed)

    checks, rows, prefill, swept = [], [], [], []
    if dev.type == "cuda":
        checks += check_graph_and_sync(dev, gd)
    for name, in_f, out_f in shapes:
        t0 = time.time()
        copies = 1 if dev.type != "cuda" else max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / (in_f * out_f))))
        fp8_ws, bf16_ws = make_weight(in_f, out_f, dev, gd, copies)
        checks += check_shape(name, in_f, out_f, *fp8_ws[0], dev, gd, tokens=(1, 3) if args.smoke else (1, 64))
        for n in tokens:
            rows.append(time_shape(name, in_f, out_f, fp8_ws, bf16_ws, n, dev, gd))
        if args.prefill_tokens and (args.smoke or any(k in name for k in PREFILL_SHAPES)):
            n = 37 if args.smoke else args.prefill_tokens
            r = time_shape(name, in_f, out_f, fp8_ws[:1], bf16_ws[:1], n, dev, gd)
            r["g_ms"] = r["bf16_g_ms"] = None
            prefill.append(r)
        if args.sweep:
            for n in ([1] if args.smoke else sweep_tokens):
                base = f8.get_config(n, act_fp8=ACT_FP8[0])
                auto = f8.split_k(n, out_f, in_f, base, f8.sm_count(dev))[0]
                for cfg in ([base] + SWEEP_CONFIGS[:2] if args.smoke else [base] + sweep_configs):
                    own = f8.split_k(n, out_f, in_f, cfg, f8.sm_count(dev))[0]  # the heuristic for this tile
                    for sp in sorted({1, auto, 2 * auto, own, 2 * own, 4 * own}):
                        try:
                            r = time_shape(name, in_f, out_f, fp8_ws, bf16_ws, n, dev, gd, config=cfg, splits=sp)
                            r["table"] = cfg is base and sp == auto
                        except Exception as err:  # noqa: BLE001 - a tile that does not compile is a result
                            r = dict(shape=name, tokens=n, cfg=cfg, splits=sp, error=f"{type(err).__name__}: {err}"[:200])
                        swept.append(r)
        del fp8_ws, bf16_ws
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"shape {name} done in {time.time() - t0:.1f}s", flush=True)

    write_out("fp8_linear_h200.json", dict(env=env, checks=checks, rows=rows, prefill=prefill, sweep=swept))

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    if swept:
        print("\nsweep (best 3 per shape and N; * = the table's choice):")
        for name, _, _ in shapes:
            for n in ([1] if args.smoke else sweep_tokens):
                ok = sorted((r for r in swept if r["shape"] == name and r["tokens"] == n and "ms" in r),
                            key=lambda r: r.get("g_ms") or r["ms"])
                for r in ok[:3] + [r for r in ok[3:] if r.get("table")]:
                    c = r["cfg"]
                    print(f"  {name:<22} N={n:<4} {'*' if r.get('table') else ' '} M{c['BLOCK_M']} N{c['BLOCK_N']} "
                          f"K{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}{' swap' if c.get('SWAP_AB') else ''} "
                          f"split {r['splits']:<3} "
                          f"{f(r.get('g_ms') or r['ms'], '.4f')} ms")
    bad = [c for c in checks if not c["pass"]]
    print(f"\nchecks: {len(checks) - len(bad)}/{len(checks)} pass"
          + ("" if not bad else "  FAILED: " + ", ".join(f"{c['check']} N={c.get('tokens')}" for c in bad)))
    print(f"decode, activations {args.act} (g_* = CUDA-graph replay over rotating weight copies, per call; "
          "ratio = fp8 / bf16 time):")
    print(f"{'shape':<34} {'in':>5} {'out':>6} {'N':>4} {'split':>5} {'fp8 us':>8} {'g us':>8} {'GB/s':>6} "
          f"{'%4.09T':>6} {'bf16 us':>8} {'g us':>8} {'ratio':>5}")
    for r in rows:
        print(f"{r['shape'][:34]:<34} {r['in_f']:>5} {r['out_f']:>6} {r['tokens']:>4} {r['splits']:>5} "
              f"{f(r['ms'] * 1e3, '8.1f')} {f(r['g_ms'] and r['g_ms'] * 1e3, '8.1f')} "
              f"{f(r.get('g_gbps', r.get('gbps')), '6.0f')} {f(r['pct_bw'], '6.1f')} "
              f"{f(r['bf16_ms'] * 1e3, '8.1f')} {f(r['bf16_g_ms'] and r['bf16_g_ms'] * 1e3, '8.1f')} "
              f"{f(r['ratio'], '5.2f')}")
    if prefill:
        print("prefill (do_bench, L2 flushed):")
        for r in prefill:
            print(f"{r['shape'][:34]:<34} {r['in_f']:>5} {r['out_f']:>6} {r['tokens']:>5}  fp8 {r['ms']:.3f} ms "
                  f"{r['tflops']:.0f} TFLOP/s   bf16 {r['bf16_ms']:.3f} ms {r['bf16_tflops']:.0f} TFLOP/s   "
                  f"ratio {r['ms'] / r['bf16_ms']:.2f}")
    print(f"total {time.time() - t_start:.1f}s", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
