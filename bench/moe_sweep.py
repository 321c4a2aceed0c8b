"""Tile sweeps of the fused MoE: the alternatives to the tile table's entries (bf16, fp8 w8a16,
fp8 w8a8; decode and prefill), each timed as a whole call. Driven by `python3 -m bench.moe_h200 --sweep`.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.h200 import CEILING_TBPS
from bench.moe_cases import BLOCK, expert_bytes, make_inputs, table_config, weights_of
from backends.kernels import fused_moe as fm

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


def _smem_ok_a8(c: dict) -> bool:
    """w8a8 tiles: e4m3 activations and weights (1 byte each) per stage, nothing converted."""
    bm = c["BLOCK_M"]
    return max(p["num_stages"] * (bm + nw * p["BLOCK_N"]) * p["BLOCK_K"]
               for p, nw in ((c["gate_up"], 2), (c["down"], 1))) <= 220 * 1024


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
    # a batch-1 step reaches 8 experts + the shared one: 64-wide tiles give 2-4 programs per SM
    _cfg8(16, (64, 128, 4, 4), (64, 128, 4, 4), SWAP_AB=True),
    _cfg8(16, (64, 128, 4, 6), (64, 128, 4, 6), SWAP_AB=True),
    _cfg8(16, (64, 128, 4, 3), (128, 128, 4, 3), SWAP_AB=True),
    _cfg8(16, (128, 128, 4, 4), (64, 128, 4, 6), SWAP_AB=True),
    _cfg8(16, (128, 128, 8, 3), (64, 128, 4, 4), SWAP_AB=True),
) if _smem_ok_a8(c)]
SWEEP_FP8["prefill-a8"] = [c for c in (
    _cfg8(128, (64, 128, 8, 3), (128, 128, 8, 3), 8),
    _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 3), 8),
    _cfg8(128, (128, 128, 8, 3), (256, 128, 8, 3), 8),             # bf16's 16K shape (gate/up 128, down 256)
    _cfg8(128, (64, 128, 8, 5), (128, 128, 8, 5), 8),
    _cfg8(64, (64, 128, 4, 4), (128, 128, 4, 4), 8),
    _cfg8(64, (64, 128, 4, 4), (128, 128, 4, 4), 16),
    _cfg8(128, (128, 128, 8, 4), (128, 128, 8, 4), 8),
    _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 4), 8),
    _cfg8(128, (128, 128, 8, 4), (128, 128, 8, 3), 8),
    _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 3), 4),
    _cfg8(128, (128, 128, 8, 3), (128, 128, 8, 3), 16),
    _cfg8(128, (128, 128, 8, 3), (64, 128, 4, 4), 8),
) if _smem_ok_a8(c)]


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
            # decode sizes: a CUDA graph of 2 calls per input set (as in a decode step; eager
            # timing of a few-token call is the host's launch time, not the kernels')
            ms = graph_ms(run, 2 * len(sets), kernel_ms) if dev.type == "cuda" and n <= args.graph_max \
                else kernel_ms(run)
            rec.update(ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12, pct_bw=100 * nbytes / (ms * 1e-3) / 1e12 / CEILING_TBPS,
                       tflops=6.0 * n * dims["k"] * dims["i"] * dims["d"] / (ms * 1e-3) / 1e12)
        except Exception as err:  # noqa: BLE001 - a shape that does not compile is a result too
            rec["error"] = f"{type(err).__name__}: {str(err)[:160]}"
        res.append(rec)
        print("sweep", json.dumps(rec), flush=True)
    return res


def graph_ms(run, calls: int, kernel_ms) -> float:
    """ms per call of `calls` back-to-back calls of run, captured in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    torch.cuda.synchronize()
    ms = kernel_ms(graph.replay) / calls
    del graph
    return ms


def _cfg_str(c: dict) -> str:
    def one(p: dict) -> str:
        flags = ("S" if p.get("SWAP_AB") else "") + ("E" if p.get("scale_acc", True) is False else "")
        return f"N{p['BLOCK_N']}K{p['BLOCK_K']}w{p['num_warps']}s{p['num_stages']}{flags}"
    return f"M{c['BLOCK_M']} gu:{one(c['gate_up'])} dn:{one(c['down'])}"


def print_sweep(swept: list, sweep_tokens: list[int]) -> None:
    """The sweep's best tiles per case, failures, and the best per N as a table row."""
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

