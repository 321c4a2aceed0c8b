"""The fused routed-expert MoE of the cuda-h200 backend on the GPU: correctness, then speed.

    python3 -m bench.moe_h200                     # H200, full GLM-5.3-Flash MoE shapes
    python3 -m bench.moe_h200 --sweep             # + tile sweep at a few token counts
    python3 -m bench.moe_h200 --sweep --sweep-only --kinds fp8 --sweep-tokens 1,16,64,128 \
        --check-tokens 1,64                       # fp8 decode tiles only (~1-2 min): checks,
                                                  # then the fp8 sweep + bf16 table baseline,
                                                  # best per N printed as a FP8_CONFIGS row
    python3 -m bench.moe_h200 --smoke             # tiny sizes; on a CPU-only machine it runs
                                                  # the kernels in Triton's interpreter

Shapes: hidden D 4096, 288 experts, top-8, moe_intermediate I 2048, clamp 10, stacked weights
gate/up [E, I, D] and down [E, D, I], bf16 and fp8 e4m3 with 128x128 block scales (one
layer's worth of experts: 14.5 GB bf16 + 7.2 GB fp8 resident). Routing as in the model: a
sigmoid router (random [E, D] gate, correction bias) with top-8 of 288, normalised, x2.5
(`ReferenceOps.moe_route`, also checked here to run without a host sync).

1. Correctness (per weight dtype): the kernel (output NaN-poisoned first) against
   ReferenceOps.moe_experts in the same dtype, and both against an fp32 evaluation of the
   routed experts ("truth", N <= 8 only: it upcasts just the routed experts' weights);
   METHOD.md bound for bf16 operands: ‖out − ref‖/‖ref‖ < 1e-2. Also: two runs bitwise equal
   (deterministic top-k sum), no host sync (torch.cuda.set_sync_debug_mode("error") around
   route + experts), and a CUDA-graph capture replayed on new inputs equals eager.
2. Timing at N = 1, 16, 64, 128 (decode) and 4096, 16384 (prefill): `triton.testing.do_bench`
   median (L2 flushed between runs) rotating over 4 input sets (different experts routed);
   for N <= 128 also a CUDA-graph replay of the whole op (launch gaps removed). Bytes = the
   weights of the experts actually routed (unique experts per input set, averaged; + fp8
   scales) + x read + out written; FLOPs = 6·N·top_k·I·D. Against the measured H200 ceilings
   (4.09 TB/s copy, 779 TFLOP/s bf16 matmul on random data, see KINDS.md); the floor is the
   larger of bytes/4.09 TB/s and FLOPs/779 TFLOP/s. Reference time: median of 3 event-timed
   calls of ReferenceOps.moe_experts (its per-expert loop).

Floors at full size: decode N=1 routes 8 experts = 403 MB bf16 (98 us) / 202 MB fp8 (49 us);
N=128 routes ~280 experts = ~14 GB bf16 (~3.4 ms). Prefill N=16384: 6.6 TFLOP (8.5 ms at 779)
against 14.5 GB of weights (3.5 ms): compute-bound; N=4096: 1.65 TFLOP (2.1 ms) vs 3.5 ms of
weight reads: still memory-bound.

A short table is printed last; with $OUT set, everything also goes to $OUT/moe_h200.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TBPS, CEILING_TFLOPS, interpret_if_smoke, kernel_device, write_out  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from bench.timing import timers  # noqa: E402

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import fused_moe as fm  # noqa: E402
from backends.reference import ReferenceOps, dequantize_block_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)

FULL = dict(d=4096, i=2048, e=288, k=8, limit=10.0, scaling=2.5)
SMOKE = dict(d=256, i=128, e=16, k=4, limit=10.0, scaling=2.5)

def _smem_ok(c: dict) -> bool:
    """Pipelined bf16 tiles of both GEMMs fit the 227 KB a block may have (sm_90)."""
    bm, g, d = c["BLOCK_M"], c["gate_up"], c["down"]
    gu = g["num_stages"] * (bm + 2 * g["BLOCK_N"]) * g["BLOCK_K"] * 2
    dn = d["num_stages"] * (bm + d["BLOCK_N"]) * d["BLOCK_K"] * 2
    return max(gu, dn) <= 220 * 1024


def _cfg(bm: int, n: int, n2: int, kk: int, g: int, w: int, s: int) -> dict:
    return dict(BLOCK_M=bm, gate_up=dict(BLOCK_N=n, BLOCK_K=kk, GROUP_M=g, num_warps=w, num_stages=s),
                down=dict(BLOCK_N=n2, BLOCK_K=kk, GROUP_M=g, num_warps=w, num_stages=s))


SWEEP = {  # alternatives to the table's entry (BLOCK_M + both GEMMs' tiles); sm_90 compiles checked
    "decode": [c for c in (_cfg(16, n, n2, kk, 1, w, s)
                           for n, n2 in ((32, 64), (64, 64), (64, 128), (128, 128)) for kk in (64, 128)
                           for w, s in ((4, 3), (4, 5), (8, 4)) if kk == 128 or (n, w) == (64, 4))
               if _smem_ok(c)],
    "prefill": [c for c in (_cfg(bm, n, 2 * n, kk, 8, w, s)
                            for bm in (64, 128) for n in (64, 128) for kk in (64, 128)
                            for w, s in ((4, 3), (8, 3), (8, 4)) if not (bm == 128 and w == 4))
                if _smem_ok(c)],
}


def _smem_ok_fp8(c: dict) -> bool:
    """fp8 weight tiles (1 byte) + bf16 activation tiles per stage, + the converted bf16 weight
    tile once (unless SWAP_AB: there it can stay in registers), within the 227 KB of sm_90."""
    bm = c["BLOCK_M"]

    def need(p: dict, nw: int) -> int:
        stage = bm * p["BLOCK_K"] * 2 + nw * p["BLOCK_N"] * p["BLOCK_K"]
        cvt = 0 if p.get("SWAP_AB") else nw * p["BLOCK_N"] * p["BLOCK_K"] * 2
        return p["num_stages"] * stage + cvt

    return max(need(c["gate_up"], 2), need(c["down"], 1)) <= 220 * 1024


def _cfg8(bm: int, gu: tuple, dn: tuple, group: int = 1, **extra) -> dict:
    """fp8 sweep entry: gu/dn = (BLOCK_N, BLOCK_K, num_warps, num_stages); extra (SWAP_AB,
    scale_acc) goes to both GEMMs."""
    def part(t):
        return dict(BLOCK_N=t[0], BLOCK_K=t[1], GROUP_M=group, num_warps=t[2], num_stages=t[3], **extra)
    return dict(BLOCK_M=bm, gate_up=part(gu), down=part(dn))


# fp8 alternatives to FP8_CONFIGS' entry (edit freely; the table's entry is always timed first and
# duplicates of it are skipped). Kept short so that `--sweep --kinds fp8` stays a ~1-2 minute run.
SWEEP_FP8 = {
    "decode": [c for c in (
        _cfg8(16, (64, 128, 4, 4), (64, 128, 4, 4)),                    # bf16's tiles, scale on acc
        _cfg8(16, (64, 128, 4, 4), (64, 128, 4, 4), scale_acc=False),   # ... per element (before)
        _cfg8(16, (64, 128, 4, 6), (128, 128, 4, 6)),                   # deeper pipeline
        _cfg8(16, (128, 128, 4, 4), (128, 128, 4, 4)),
        _cfg8(16, (128, 128, 8, 4), (128, 128, 8, 5)),
        _cfg8(16, (256, 64, 8, 4), (256, 128, 8, 4)),                   # one scale per column
        _cfg8(16, (64, 128, 4, 4), (128, 128, 4, 4), SWAP_AB=True),     # weights as MMA A operand
        _cfg8(16, (128, 128, 8, 4), (128, 128, 8, 5), SWAP_AB=True),
    ) if _smem_ok_fp8(c)],
    "prefill": [c for c in (
        _cfg8(128, (64, 64, 8, 3), (128, 64, 8, 3), 8),                 # bf16's tiles, scale on acc
        _cfg8(128, (64, 64, 8, 3), (128, 64, 8, 3), 8, scale_acc=False),
        _cfg8(128, (128, 64, 8, 4), (256, 64, 8, 3), 8),
        _cfg8(128, (64, 128, 8, 3), (128, 128, 8, 3), 8, SWAP_AB=True),
        _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 3), 8, SWAP_AB=True),
        _cfg8(64, (64, 128, 4, 4), (128, 128, 4, 4), 8),
    ) if _smem_ok_fp8(c)],
}


# w8a8 alternatives (kind "fp8a8": the fp8 weights with act_fp8, activations quantised on the fly):
# the table's tiles, and SWAP_AB tiles, where the product is an fp8 wgmma (m64nNk32, no convert).
SWEEP_FP8["decode-a8"] = [c for c in (
    _cfg8(16, (128, 128, 8, 4), (128, 128, 8, 5), SWAP_AB=True),      # the table's (1 program per SM)
    _cfg8(16, (128, 128, 4, 3), (128, 128, 4, 4), SWAP_AB=True),      # 2 programs per SM
    _cfg8(16, (128, 128, 8, 3), (128, 128, 8, 4), SWAP_AB=True),
    _cfg8(16, (64, 128, 4, 4), (128, 128, 4, 4), SWAP_AB=True),
    _cfg8(16, (64, 128, 4, 3), (64, 128, 4, 4), SWAP_AB=True),
    _cfg8(16, (256, 128, 8, 3), (256, 128, 8, 4), SWAP_AB=True),       # more bytes per stage
    _cfg8(16, (128, 128, 8, 4), (128, 128, 8, 5)),                     # mma.sync on f16-converted fp8
    _cfg8(16, (64, 128, 4, 4), (64, 128, 4, 4)),
    _cfg8(32, (128, 128, 4, 4), (128, 128, 4, 4), SWAP_AB=True),
) if _smem_ok_fp8(c)]
SWEEP_FP8["prefill-a8"] = [c for c in (
    _cfg8(128, (64, 128, 8, 3), (128, 128, 8, 3), 8),
    _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 3), 8),
    _cfg8(128, (128, 128, 8, 3), (256, 128, 8, 3), 8),             # bf16's 16K shape (gate/up 128, down 256)
    _cfg8(128, (64, 128, 8, 5), (128, 128, 8, 5), 8),
    _cfg8(64, (64, 128, 4, 4), (128, 128, 4, 4), 8),
) if _smem_ok_fp8(c)]


def weights_of(kind: str) -> str:
    """fp8a8 runs the fp8 weights (w8a8: act_fp8=True)."""
    return "fp8" if kind == "fp8a8" else kind


def table_config(kind: str, n: int) -> dict:
    return fm.get_config(n, torch.bfloat16, FP8 if weights_of(kind) == "fp8" else torch.bfloat16, kind == "fp8a8")


# ---------------------------------------------------------------------------------------
def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def make_weights(dims: dict, dev: torch.device, gd: torch.Generator, kinds=("bf16", "fp8")) -> dict:
    e, d, i = dims["e"], dims["d"], dims["i"]
    shapes = ((e, i, d), (e, i, d), (e, d, i))
    gate_w = torch.randn(e, d, device=dev, generator=gd, dtype=torch.bfloat16).mul_(d ** -0.5)
    bias = torch.randn(e, device=dev, generator=gd).mul_(0.05)
    out = dict(gate_w=gate_w, bias=bias)
    if "bf16" in kinds:
        out["bf16"] = ([torch.randn(s, device=dev, dtype=torch.bfloat16, generator=gd).mul_(s[2] ** -0.5)
                        for s in shapes], None)
    if "fp8" in kinds:
        fp8 = []
        for s in shapes:  # e4m3 values ~N(0, 1), scales ~fan_in^-0.5: weights of the same size as bf16's
            fp8.append(torch.randn(s, device=dev, dtype=torch.bfloat16, generator=gd).to(FP8))
        scales = tuple(torch.rand(e, triton.cdiv(o, BLOCK[0]), triton.cdiv(c, BLOCK[1]), device=dev, generator=gd)
                       .add_(0.5).mul_(c ** -0.5) for (_, o, c) in shapes)
        out["fp8"] = (fp8, scales)
    return out


def make_inputs(n: int, dims: dict, w: dict, dev: torch.device, gd: torch.Generator, sets: int) -> list:
    ops = ReferenceOps()
    out = []
    for _ in range(sets):
        x = torch.randn(n, dims["d"], device=dev, generator=gd, dtype=torch.bfloat16)
        rw, ids = ops.moe_route(x, w["gate_w"], w["bias"], dims["k"], 1, 1, True, dims["scaling"])
        out.append((x, ids, rw))
    return out


def truth_fp32(x, ids, rw, ws, scales, limit):
    """fp32 MoE over the routed experts only (their weights upcast; ids remapped)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    if scales is None:
        wf = [w[uniq].float() for w in ws]
    else:
        wf = [dequantize_block_fp8(w[uniq], s[uniq], BLOCK, torch.float32) for w, s in zip(ws, scales)]
    return ReferenceOps().moe_experts(x.float(), inv.view(ids.shape), rw, *wf, limit)


def check(kind: str, w: dict, dims: dict, dev: torch.device, gd: torch.Generator, tokens: list[int],
          truth_max: int) -> list[dict]:
    ws, scales = w[weights_of(kind)]
    a8 = kind == "fp8a8"
    ref_ops = ReferenceOps()
    ref_ops.fp8_activations = "dynamic" if a8 else "none"
    rows = []
    for n in tokens:
        (x, ids, rw), = make_inputs(n, dims, w, dev, gd, 1)
        out = torch.full_like(x, float("nan"))
        try:
            fm.fused_moe(x, ids, rw, *ws, dims["limit"], scales, BLOCK, out=out, act_fp8=a8)
            again = fm.fused_moe(x, ids, rw, *ws, dims["limit"], scales, BLOCK, act_fp8=a8)
        except Exception as err:  # noqa: BLE001 - e.g. a table entry that does not compile: go on to the sweep
            row = dict(check=kind, tokens=n, experts=int(torch.unique(ids).numel()), nan=True, deterministic=False,
                       rel_vs_ref=float("nan"), max_abs_vs_ref=float("nan"), pass_=False,
                       error=f"{type(err).__name__}: {str(err)[:200]}", config=table_config(kind, n))
            row["pass"] = row.pop("pass_")
            rows.append(row)
            print("check", json.dumps(row), flush=True)
            continue
        ref = ref_ops.moe_experts(x, ids, rw, *ws, dims["limit"], scales, BLOCK)
        row = dict(check=kind, tokens=n, experts=int(torch.unique(ids).numel()),
                   nan=bool(torch.isnan(out).any()), deterministic=bool(torch.equal(out, again)),
                   rel_vs_ref=_rel(out, ref), max_abs_vs_ref=float((out.float() - ref.float()).abs().max()))
        if n <= truth_max:
            t = truth_fp32(x, ids, rw, ws, scales, dims["limit"])
            row.update(rel_ours_truth=_rel(out, t), rel_ref_truth=_rel(ref, t))
        # fp8: the kernel scales fp32 partials where the reference rounds w·s to bf16 first, so the
        # two differ by about the reference's own error: vs ref loosely, vs the fp32 truth at 1e-2.
        # fp8a8 against its own (w8a8) reference; its distance to the unquantised truth is the
        # activations' e4m3 rounding (~3%), reported, bounded at 6e-2
        bound = 1e-2
        row["pass"] = (not row["nan"] and row["deterministic"]
                       and row["rel_vs_ref"] < (2 * bound if kind != "bf16" else bound)
                       and row.get("rel_ours_truth", 0.0) < (6 * bound if a8 else bound))
        rows.append(row)
        print("check", json.dumps(row), flush=True)
        del out, again, ref
    return rows


def check_graph_and_sync(w: dict, dims: dict, dev: torch.device, gd: torch.Generator, n: int = 16) -> dict:
    """No host sync in route + experts, and a captured graph replays right on new inputs."""
    ws, scales = w["fp8"]
    ops = CudaH200Ops()
    (x, _, _), = make_inputs(n, dims, w, dev, gd, 1)

    def step():
        rw, ids = ops.moe_route(x, w["gate_w"], w["bias"], dims["k"], 1, 1, True, dims["scaling"])
        return ops.moe_experts(x, ids, rw, *ws, dims["limit"], scales, BLOCK)

    res: dict = dict(check="graph+sync", tokens=n)
    try:
        step()
    except Exception as err:  # noqa: BLE001
        res.update(no_host_sync=False, graph_equal_eager=False, error=f"{type(err).__name__}: {str(err)[:200]}")
        res["pass"] = False
        print("check", json.dumps(res), flush=True)
        return res
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        step()
        res["no_host_sync"] = True
    except RuntimeError as err:
        res["no_host_sync"] = False
        res["sync_error"] = str(err)[:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        x.copy_(torch.randn(x.shape, device=dev, generator=gd, dtype=x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        res["graph_equal_eager"] = bool(torch.equal(static, step()))
    except Exception as err:  # noqa: BLE001 - a failed capture is a result
        res["graph_equal_eager"] = False
        res["graph_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    res["pass"] = res["no_host_sync"] and res["graph_equal_eager"]
    print("check", json.dumps(res), flush=True)
    return res


def expert_bytes(dims: dict, kind: str) -> float:
    d, i = dims["d"], dims["i"]
    if kind == "bf16":
        return 3 * d * i * 2
    return 3 * d * i + 3 * (d // BLOCK[0]) * (i // BLOCK[1]) * 4


def time_case(kind: str, n: int, w: dict, dims: dict, dev: torch.device, gd: torch.Generator, args,
              kernel_ms, ref_ms) -> dict:
    ws, scales = w[weights_of(kind)]
    a8 = kind == "fp8a8"
    sets = make_inputs(n, dims, w, dev, gd, args.rotate)
    d, i, k, lim = dims["d"], dims["i"], dims["k"], dims["limit"]
    uniq = statistics.mean(int(torch.unique(ids).numel()) for _, ids, _ in sets)
    nbytes = uniq * expert_bytes(dims, weights_of(kind)) + 2 * n * d * 2
    flops = 6.0 * n * k * i * d
    outs = [torch.empty_like(x) for x, _, _ in sets]
    it = [0]

    def run():
        j = it[0] % len(sets)
        it[0] += 1
        x, ids, rw = sets[j]
        fm.fused_moe(x, ids, rw, *ws, lim, scales, BLOCK, out=outs[j], act_fp8=a8)

    run()
    ms = kernel_ms(run)
    x0, ids0, rw0 = sets[0]
    cfg = table_config(kind, n)
    align_ms = kernel_ms(lambda: fm.moe_align(ids0, dims["e"], cfg["BLOCK_M"]))
    row = dict(kind=kind, tokens=n, experts_routed=uniq, ms=ms, align_ms=align_ms, gbytes=nbytes / 1e9,
               tbps=nbytes / (ms * 1e-3) / 1e12, tflops=flops / (ms * 1e-3) / 1e12, config=cfg)
    row["pct_bw"] = 100 * row["tbps"] / CEILING_TBPS
    row["pct_flops"] = 100 * row["tflops"] / CEILING_TFLOPS
    row["floor_ms"] = max(nbytes / (CEILING_TBPS * 1e12), flops / (CEILING_TFLOPS * 1e12)) * 1e3
    row["x_floor"] = ms / row["floor_ms"]
    if dev.type == "cuda" and n <= args.graph_max:
        try:
            out_g = torch.empty_like(x0)
            fm.fused_moe(x0, ids0, rw0, *ws, lim, scales, BLOCK, out=out_g, act_fp8=a8)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fm.fused_moe(x0, ids0, rw0, *ws, lim, scales, BLOCK, out=out_g, act_fp8=a8)
            row["graph_ms"] = kernel_ms(graph.replay)
            del graph
        except Exception as err:  # noqa: BLE001
            row["graph_error"] = f"{type(err).__name__}: {str(err)[:160]}"
    if not args.no_ref and n <= args.ref_max:
        ref = ReferenceOps()
        ref.fp8_activations = "dynamic" if a8 else "none"
        row["ref_ms"] = ref_ms(lambda: ref.moe_experts(x0, ids0, rw0, *ws, lim, scales, BLOCK))
        row["speedup"] = row["ref_ms"] / ms
    print("case", json.dumps(row, default=str), flush=True)
    del sets, outs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sweep(kind: str, n: int, w: dict, dims: dict, dev: torch.device, gd: torch.Generator, args, kernel_ms,
          baseline: bool = False) -> list:
    """Time the table's entry and the sweep list's alternatives for `kind` at N tokens (baseline:
    the table's entry only, for the fp8/bf16 ratio)."""
    ws, scales = w[weights_of(kind)]
    a8 = kind == "fp8a8"
    sets = make_inputs(n, dims, w, dev, gd, args.rotate)
    uniq = statistics.mean(int(torch.unique(ids).numel()) for _, ids, _ in sets)
    nbytes = uniq * expert_bytes(dims, weights_of(kind)) + 2 * n * dims["d"] * 2
    outs = [torch.empty_like(x) for x, _, _ in sets]
    table = table_config(kind, n)
    lists = SWEEP_FP8 if weights_of(kind) == "fp8" else SWEEP
    phase = ("decode" if n <= 1024 else "prefill") + ("-a8" if a8 else "")
    cands = [table] + ([] if baseline else [c for c in lists[phase] if c != table])
    res = []
    for ci, cfg in enumerate(cands):
        it = [0]

        def run():
            j = it[0] % len(sets)
            it[0] += 1
            x, ids, rw = sets[j]
            fm.fused_moe(x, ids, rw, *ws, dims["limit"], scales, BLOCK, out=outs[j], config=cfg, act_fp8=a8)

        rec = dict(kind=kind, tokens=n, table=ci == 0, baseline=baseline, config=cfg)
        try:
            t = time.time()
            run()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rec["compile_s"] = time.time() - t
            ms = kernel_ms(run)
            rec.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12, pct_bw=100 * nbytes / (ms * 1e-3) / 1e12 / CEILING_TBPS,
                       tflops=6.0 * n * dims["k"] * dims["i"] * dims["d"] / (ms * 1e-3) / 1e12)
        except Exception as err:  # noqa: BLE001 - a shape that does not compile is a result too
            rec["error"] = f"{type(err).__name__}: {str(err)[:160]}"
        res.append(rec)
        print("sweep", json.dumps(rec), flush=True)
    return res


_TMA_KEYS = dict(bm="BLOCK_M", a="A_TMA", gn="gate_up.BLOCK_N", gk="gate_up.BLOCK_K", gw="gate_up.num_warps",
                 gs="gate_up.num_stages", gg="gate_up.GROUP_M", gws="gate_up.WARP_SPECIALIZE",
                 dn="down.BLOCK_N", dk="down.BLOCK_K", dw="down.num_warps", ds="down.num_stages",
                 dg="down.GROUP_M", dws="down.WARP_SPECIALIZE")


def tma_config(spec: str) -> dict:
    """fused_moe_tma.CONFIG with a spec's changes: "bm=64,gn=128,gs=3,dws=1" (keys: _TMA_KEYS)."""
    from backends.kernels import fused_moe_tma

    c = fused_moe_tma.merged_config()
    for item in filter(None, spec.split(",")):
        key, val = item.split("=")
        path = _TMA_KEYS[key.strip()].split(".")
        v = int(val)
        if path[-1] in ("A_TMA", "WARP_SPECIALIZE"):
            v = bool(v)
        (c[path[0]] if len(path) == 2 else c)[path[-1]] = v
    return c


def tma_sweep(n: int, w: dict, dims: dict, dev: torch.device, gd: torch.Generator, args, kernel_ms) -> list:
    """bf16 at N tokens: the pointer GEMMs (the table's entry) against each --tma-sweep spec of the
    sorted-row TMA GEMMs, whole fused_moe calls (alignment, gather, GEMMs, sum) each; every TMA
    output compared with the pointer GEMMs' on the same inputs."""
    from backends.kernels import fused_moe_tma

    ws, _ = w["bf16"]
    sets = make_inputs(n, dims, w, dev, gd, args.rotate)
    flops = 6.0 * n * dims["k"] * dims["i"] * dims["d"]
    outs = [torch.empty_like(x) for x, _, _ in sets]
    x0, ids0, rw0 = sets[0]
    ptr = fm.fused_moe(x0, ids0, rw0, *ws, dims["limit"], tma=False)
    res = []
    for spec in ["pointer"] + args.tma_sweep.split(";"):
        cfg = None if spec == "pointer" else tma_config(spec)
        it = [0]

        def run():
            j = it[0] % len(sets)
            it[0] += 1
            x, ids, rw = sets[j]
            fm.fused_moe(x, ids, rw, *ws, dims["limit"], out=outs[j], tma=cfg is not None, config=cfg)

        rec = dict(tokens=n, spec=spec)
        refused = len(fused_moe_tma.refusals())
        try:
            t = time.time()
            got = fm.fused_moe(x0, ids0, rw0, *ws, dims["limit"], tma=cfg is not None, config=cfg)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rec["compile_s"] = time.time() - t
            if cfg is not None and len(fused_moe_tma.refusals()) > refused:  # it fell back to the pointer GEMMs
                raise RuntimeError(list(fused_moe_tma.refusals().values())[-1])
            rec["rel_vs_pointer"] = _rel(got, ptr)
            ms = kernel_ms(run)
            rec.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as err:  # noqa: BLE001 - a shape that does not compile is a result too
            rec["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        res.append(rec)
        print("tma", json.dumps(rec), flush=True)
    del sets, outs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _cfg_str(c: dict) -> str:
    def one(p: dict) -> str:
        flags = ("S" if p.get("SWAP_AB") else "") + ("E" if p.get("scale_acc", True) is False else "")
        return f"N{p['BLOCK_N']}K{p['BLOCK_K']}w{p['num_warps']}s{p['num_stages']}{flags}"
    return f"M{c['BLOCK_M']} gu:{one(c['gate_up'])} dn:{one(c['down'])}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,64,128,4096,16384")
    p.add_argument("--kinds", default="bf16,fp8", help="bf16, fp8 (w8a16), fp8a8 (fp8 weights, w8a8)")
    p.add_argument("--check-tokens", default="1,5,64,4096")
    p.add_argument("--truth-max", type=int, default=8, help="largest N checked against fp32 too")
    p.add_argument("--rotate", type=int, default=4, help="input sets cycled while timing")
    p.add_argument("--graph-max", type=int, default=128, help="largest N also timed as a CUDA-graph replay")
    p.add_argument("--ref-max", type=int, default=16384, help="largest N the reference is timed at")
    p.add_argument("--no-ref", action="store_true")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-tokens", default="1,128,16384")
    p.add_argument("--sweep-only", action="store_true", help="with --sweep / --tma-sweep: checks + sweeps, no "
                   "timing table")
    p.add_argument("--no-baseline", action="store_true",
                   help="fp8 sweep without timing bf16's table entry at the same N (needs bf16 weights)")
    p.add_argument("--tma-sweep", default="", help="bf16 at --sweep-tokens: the pointer GEMMs against these "
                   "';'-separated fused_moe_tma configs (e.g. 'bm=128;a=0;gws=1,dws=1'; an empty spec is CONFIG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    args = p.parse_args(argv)

    dev = kernel_device()
    if dev is None:
        return 2
    dims = SMOKE if args.smoke else FULL
    tokens = [1, 5, 33] if args.smoke else [int(t) for t in args.tokens.split(",")]
    check_tokens = [1, 5, 33] if args.smoke else [int(t) for t in args.check_tokens.split(",")]
    sweep_tokens = [1, 33] if args.smoke else [int(t) for t in args.sweep_tokens.split(",")]
    if args.smoke:
        for lists in (SWEEP, SWEEP_FP8):
            for phase in lists:
                lists[phase] = lists[phase][:2]
    kinds = args.kinds.split(",")
    baseline = args.sweep and "bf16" not in kinds and not args.no_baseline
    kernel_ms, ref_ms = timers(dev, host_repeats=2)
    env = dict(torch=torch.__version__, triton=triton.__version__, device=str(dev),
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
               dims=dims, ceiling_tbps=CEILING_TBPS, ceiling_tflops=CEILING_TFLOPS)
    print("env", env, flush=True)

    t0 = time.time()
    gd = torch.Generator(device=dev).manual_seed(args.seed)
    w = make_weights(dims, dev, gd, [weights_of(k) for k in kinds] + (["bf16"] if baseline else []))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"weights ready in {time.time() - t0:.1f}s", flush=True)

    checks = []
    for kind in kinds:
        checks += check(kind, w, dims, dev, gd, check_tokens, args.truth_max)
    if dev.type == "cuda" and "fp8" in w:
        checks.append(check_graph_and_sync(w, dims, dev, gd))
    rows = []
    for kind in ([] if (args.sweep or args.tma_sweep) and args.sweep_only else kinds):
        for n in tokens:
            t = time.time()
            rows.append(time_case(kind, n, w, dims, dev, gd, args, kernel_ms, ref_ms))
            rows[-1]["wall_s"] = time.time() - t
    swept = []
    if args.sweep:
        for kind in kinds:
            for n in sweep_tokens:
                swept += sweep(kind, n, w, dims, dev, gd, args, kernel_ms)
        if baseline:
            for n in sweep_tokens:
                swept += sweep("bf16", n, w, dims, dev, gd, args, kernel_ms, baseline=True)

    tma_rows = []
    if args.tma_sweep:
        for n in sweep_tokens:
            tma_rows += tma_sweep(n, w, dims, dev, gd, args, kernel_ms)

    write_out("moe_h200.json", dict(env=env, checks=checks, rows=rows, sweep=swept, tma=tma_rows))

    na = float("nan")
    if swept:
        print("\nsweep (best 3 per case; * = the table's entry; flags S = SWAP_AB, E = per-element scales):")
        best_rows = []
        for kind in sorted({r["kind"] for r in swept}):
            for n in sweep_tokens:
                ok = sorted((r for r in swept if r["kind"] == kind and r["tokens"] == n and "ms" in r),
                            key=lambda r: r["ms"])
                if not ok:
                    continue
                table = next((r for r in ok if r["table"]), None)
                for r in ok[:3] + ([table] if table is not None and table not in ok[:3] else []):
                    print(f"  {kind:<4} N={n:<6} {'*' if r['table'] else ' '} {_cfg_str(r['config']):<60} "
                          f"{r['ms']:9.3f} ms {r['tbps']:5.2f} TB/s {r['pct_bw']:4.0f}% {r['tflops']:6.1f} TFLOP/s")
                if not ok[0]["baseline"]:
                    best_rows.append((kind, n, ok[0], table))
        fails = [r for r in swept if "error" in r]
        for r in fails:
            print(f"  FAILED {r['kind']} N={r['tokens']} {_cfg_str(r['config'])}: {r['error']}")
        print("\nbest per N (vs the table's entry; fp8 vs bf16's table entry at the same N, target <= 0.60):")
        for kind, n, b, table in best_rows:
            bf = next((r for r in swept if r["kind"] == "bf16" and r["tokens"] == n and r["table"] and "ms" in r), None)
            ratio = f" fp8/bf16 {b['ms'] / bf['ms']:.2f} (table {table['ms'] / bf['ms']:.2f}, bf16 {bf['ms']:.3f} ms)" \
                if kind != "bf16" and bf is not None and table is not None else ""
            gain = f"x{table['ms'] / b['ms']:.2f} vs table" if table is not None else ""
            print(f"  {kind:<4} N={n:<6} {b['ms']:8.3f} ms {b['pct_bw']:4.0f}% bw {gain}{ratio}")
            print(f"       {_cfg_str(b['config'])}")
            print(f"       {b['config']!r}")
    print("\nchecks (rel = ‖a−b‖/‖b‖; bound 1e-2 for bf16 operands; fp8 vs ref 2e-2):")
    for c in checks:
        if c["check"] == "graph+sync":
            if "error" in c:
                print(f"  graph+sync N={c['tokens']}: ERROR {c['error']}  FAIL")
                continue
            print(f"  graph+sync N={c['tokens']}: no_host_sync={c['no_host_sync']} "
                  f"graph_equal_eager={c['graph_equal_eager']} {'PASS' if c['pass'] else 'FAIL'}")
            continue
        truth = (f"truth: ours {c['rel_ours_truth']:.2e} ref {c['rel_ref_truth']:.2e}" if "rel_ours_truth" in c
                 else "truth: -")
        if "error" in c:
            print(f"  {c['check']:<4} N={c['tokens']:<5} ERROR {c['error']}  FAIL")
            continue
        print(f"  {c['check']:<4} N={c['tokens']:<5} experts={c['experts']:<3} vs ref {c['rel_vs_ref']:.2e} "
              f"(max {c['max_abs_vs_ref']:.2e})  {truth:<33} det={c['deterministic']} "
              f"{'PASS' if c['pass'] else 'FAIL'}")
    if rows:
        print(f"\nfused MoE (D {dims['d']}, I {dims['i']}, E {dims['e']}, top-{dims['k']}; ceilings {CEILING_TBPS} TB/s, "
              f"{CEILING_TFLOPS:.0f} TFLOP/s; GB = routed experts' weights + x + out)")
        print(f"{'kind':<4} {'N':>6} {'exp':>5} {'ms':>8} {'graph':>7} {'align':>6} {'GB':>6} {'TB/s':>5} {'%bw':>4} "
              f"{'TFLOP/s':>7} {'%mm':>4} {'floor':>7} {'xfloor':>6} {'ref ms':>8} {'speedup':>7}")
        for r in rows:
            print(f"{r['kind']:<4} {r['tokens']:>6} {r['experts_routed']:>5.0f} {r['ms']:>8.3f} "
                  f"{r.get('graph_ms', na):>7.3f} {r['align_ms']:>6.3f} {r['gbytes']:>6.2f} {r['tbps']:>5.2f} "
                  f"{r['pct_bw']:>4.0f} {r['tflops']:>7.1f} {r['pct_flops']:>4.0f} {r['floor_ms']:>7.3f} "
                  f"{r['x_floor']:>6.2f} {r.get('ref_ms', na):>8.2f} {r.get('speedup', na):>7.1f}")
    if tma_rows:
        print("\nbf16 fused MoE: pointer GEMMs vs sorted-row TMA GEMMs (whole call; TFLOP/s of the routed rows)")
        for r in tma_rows:
            base = next((b for b in tma_rows if b["tokens"] == r["tokens"] and b["spec"] == "pointer" and "ms" in b), None)
            if "ms" not in r:
                print(f"  N={r['tokens']:<6} {r['spec']:<40} FAILED {r['error']}")
                continue
            gain = f"x{base['ms'] / r['ms']:.3f}" if base is not None else ""
            print(f"  N={r['tokens']:<6} {r['spec']:<40} {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s {gain:>7} "
                  f"rel {r['rel_vs_pointer']:.1e}")
    ok = all(c["pass"] for c in checks) and all(r.get("rel_vs_pointer", 0) < 1e-2 for r in tma_rows)
    print(f"\nchecks: {'ALL PASS' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
