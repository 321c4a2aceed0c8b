"""The w8a8 prefill GEMMs of the fused MoE, setting against setting in one process
(`python3 -m bench.moe_h200 --kinds fp8a8 --prefill-gemm "triton;sm90;sm90,down.num_warps=8"`).

A setting is `triton` (fused_moe.PREFILL_GEMM = "triton") or `sm90` with optional tiles of
fused_moe_sm90.CONFIG as `part.KEY=value` (part gate_up or down; KEY BLOCK_N, STAGES, num_warps,
GROUP_M, merged: gate/up as one product, 0 or 1). Each token count above fm.INKERNEL_QUANT_MAX_TOKENS times every setting in turn for a
few rounds over the same rotating inputs (whole fused_moe calls: alignment, act_quant of x and h,
both GEMMs, the top-k sum), and compares each setting's output with the first setting's.
"""

from __future__ import annotations

import statistics

import torch

from backends.kernels import fused_moe as fm
from bench.moe_cases import BLOCK, make_inputs, rel

_KEYS = ("BLOCK_N", "STAGES", "num_warps", "GROUP_M", "merged")


def parse_settings(spec: str) -> list[tuple[str, str, dict]]:
    """(label, PREFILL_GEMM value, fused_moe_sm90 tile overrides) per `;`-separated setting."""
    out = []
    for item in (s.strip() for s in spec.split(";") if s.strip()):
        gemm, *tiles = [t.strip() for t in item.split(",")]
        if gemm not in fm.PREFILL_GEMMS or (tiles and gemm != "sm90"):
            raise SystemExit(f"--prefill-gemm: {item!r}: a setting is one of {fm.PREFILL_GEMMS}, tiles for sm90 only")
        over: dict = {}
        for t in tiles:
            key, _, val = t.partition("=")
            part, _, name = key.partition(".")
            if part not in ("gate_up", "down") or name not in _KEYS or not val.strip().isdigit():
                raise SystemExit(f"--prefill-gemm: {t!r}: want part.KEY=int, part gate_up or down, KEY in {_KEYS}")
            over.setdefault(part, {})[name] = int(val)
        out.append((item, gemm, over))
    return out


def time_settings(spec: str, w: dict, dims: dict, dev: torch.device, gd: torch.Generator, tokens: list[int],
                  kernel_ms, rounds: int, rotate: int) -> list[dict]:
    settings = parse_settings(spec)
    from backends.kernels import fused_moe_sm90 as hopper

    ws, scales = w["fp8"]
    d, i, k, lim = dims["d"], dims["i"], dims["k"], dims["limit"]
    keep_gemm, keep_cfg = fm.PREFILL_GEMM, hopper.CONFIG
    rows = []
    try:
        for n in (t for t in tokens if t > fm.INKERNEL_QUANT_MAX_TOKENS):
            sets = make_inputs(n, dims, w, dev, gd, rotate)
            outs = [torch.empty_like(x) for x, _, _ in sets]
            it = [0]

            def run():
                j = it[0] % len(sets)
                it[0] += 1
                x, ids, rw = sets[j]
                fm.fused_moe(x, ids, rw, *ws, lim, scales, BLOCK, out=outs[j], act_fp8=True)

            times: dict[str, list[float]] = {label: [] for label, _, _ in settings}
            first = None
            for r in range(rounds):
                for label, gemm, over in settings:
                    fm.PREFILL_GEMM = gemm
                    hopper.CONFIG = {part: {**keep_cfg[part], **over.get(part, {})} for part in keep_cfg}
                    if r == 0:
                        taken = gemm == "sm90" and hopper.supported(sets[0][0], ws[0], ws[2], BLOCK)
                        x0, ids0, rw0 = sets[0]
                        y = fm.fused_moe(x0, ids0, rw0, *ws, lim, scales, BLOCK, act_fp8=True)
                        first = y if first is None else first
                        rows.append(dict(tokens=n, setting=label, taken=taken or gemm == "triton",
                                         rel_vs_first=rel(y, first)))
                    times[label].append(kernel_ms(run))
            for row in rows:
                if row["tokens"] == n:
                    ts = times[row["setting"]]
                    row.update(ms=statistics.median(ts), ms_min=min(ts), ms_max=max(ts),
                               tflops=6.0 * n * k * i * d / (statistics.median(ts) * 1e-3) / 1e12)
                    print("gemm", row, flush=True)
            sets.clear()  # free this size's inputs before the next
            outs.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        fm.PREFILL_GEMM, hopper.CONFIG = keep_gemm, keep_cfg
    return rows


def print_settings(rows: list[dict], ceiling_tflops: float) -> None:
    print(f"\nw8a8 MoE at prefill sizes, setting by setting (whole fused_moe calls; median of the rounds, "
          f"TFLOP/s = 6·N·k·I·D / time, % of {ceiling_tflops:.0f})")
    print(f"{'N':>6} {'setting':<44} {'ms':>8} {'min-max':>15} {'TFLOP/s':>8} {'%':>4} {'rel vs first':>12}")
    for r in rows:
        label = r["setting"] + ("" if r["taken"] else " (not taken: Triton ran)")
        print(f"{r['tokens']:>6} {label:<44} {r['ms']:>8.3f} {r['ms_min']:>7.3f}-{r['ms_max']:<7.3f} "
              f"{r['tflops']:>8.1f} {100 * r['tflops'] / ceiling_tflops:>4.0f} {r['rel_vs_first']:>12.1e}")
