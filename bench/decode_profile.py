"""Where the decode step's time goes on the GPU: per op and per kernel, beside the HBM floor.

    python3 -m bench.decode_profile [--preset flash-4l] [--batches 1,64] [--context 1024] [--quantization bf16,fp8]

For each batch: the step replayed from its decode CUDA graph (GPU time per replay), the sum of
the kernels inside it (from the profiler: the gap is launch bubbles between graph nodes), the
kernels grouped by name, and an eager step with every `ops.*` call and every module wrapped in
a profiler range, so each op's GPU time is attributed to what the model calls. The floor
column is `bench.decode_overlap.floor_ms`'s bytes over the copy ceiling. A short table is printed
last; JSON to $OUT/decode_profile.json when OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.h200 import CEILING_TBPS, measured_copy_tbps, write_out
from bench.timing import kernel_us, replay_ms


def kda_launch(spec: str) -> dict | None:
    """A --kda-tile variant as kda.DECODE_LAUNCH: "table" (None: kda.DECODE_LAUNCHES by batch), or
    BVxWARPSxSTAGES, e.g. "64x2x2"."""
    if spec == "table":
        return None
    return dict(zip(("BV", "num_warps", "num_stages"), (int(v) for v in spec.split("x"))))


def moe_quant_setter(fm):
    """set(variant) for --moe-quant: fused_moe's INKERNEL_QUANT_MAX_TOKENS."""
    values = {"table": fm.INKERNEL_QUANT_MAX_TOKENS, "gemm": 1024, "act_quant": 0}

    def put(v):
        fm.INKERNEL_QUANT_MAX_TOKENS = values["table" if v is None else v]
    return put


def kda_gate_place(spec: str) -> bool:
    """A --kda-decode-gate variant as kda.DECODE_GATE_IN_KERNEL: "kernel" or "launch"."""
    if spec not in ("kernel", "launch"):
        raise ValueError(f"--kda-decode-gate takes table, kernel or launch, not {spec!r}")
    return spec == "kernel"


def mla_split(spec: str) -> bool:
    """A --mla-split variant as sparse_mla.SPLIT_BY_COUNT: "count" or "width"."""
    if spec not in ("count", "width"):
        raise ValueError(f"--mla-split takes table, count or width, not {spec!r}")
    return spec == "count"


def moe_tile(spec: str) -> dict | None:
    """A --moe-tile variant as fused_moe_configs.OVERRIDE: "table" (None), or "+"-joined
    GEMM.KEY=INT / BLOCK_M=INT items, e.g. "gate_up.BLOCK_N=64+down.num_warps=4"."""
    if spec == "table":
        return None
    out: dict = {}
    for item in spec.split("+"):
        key, val = item.split("=")
        part, _, name = key.rpartition(".")
        v = int(val) if val.lstrip("-").isdigit() else val == "True"
        if part:
            out.setdefault(part, {})[name] = v
        else:
            out[name] = v
    return out


def count_experts(model, step) -> int:
    """Distinct routed experts per MoE layer, summed over the layers, in one call of `step`."""
    ops, seen = model.ops, []

    def route(*a, **k):
        weights, ids = type(ops).moe_route(ops, *a, **k)
        routed = ids if k.get("append_expert") is None else ids[:, :-1]  # not the seated shared expert
        seen.append(int(torch.unique(routed).numel()))
        return weights, ids
    ops.moe_route = route
    try:
        with torch.no_grad():
            step()
    finally:
        del ops.moe_route
    return sum(seen)


def capture_step(model, b: int, ctx: int):
    """b requests with ctx-token prompts, one eager decode step (the experts it reaches counted),
    then the decode step captured in a CUDA graph. -> (graph, experts touched, what keeps the
    graph's memory alive)."""
    from glmrt.engine.cuda_graphs import DecodeGraphs
    from glmrt.model.session import DirectSession

    vocab = model.config.text.vocab_size - 100
    prompts = torch.randint(10, vocab, (b, ctx), generator=torch.Generator().manual_seed(b))
    sess = DirectSession(model, max_requests=b + 1, max_tokens=ctx + 64, page_size=64, shuffle_pages=False)
    rids = [sess.new_request() for _ in range(b)]
    with torch.no_grad():
        for i, r in enumerate(rids):  # one at a time: bounded prefill memory at large batches
            sess.step({r: prompts[i]}, all_logits=False)
    graphs = DecodeGraphs(model, sess.cache, max_bs=b, max_pages=sess.pages_per_req, pad_slot=b,
                          pad_page=sess._free_pages[0])
    # A decode token per row, all different (one token for every row would route the whole batch
    # alike and read few experts); one eager step counts the experts this batch really reaches.
    gen = torch.Generator().manual_seed(1000 + b)
    touched = count_experts(model, lambda: sess.step(
        {r: torch.randint(10, vocab, (1,), generator=gen) for r in rids}, all_logits=False))
    lens = [sess.lens[r] for r in rids]
    key = graphs.key(b, max(n // 64 + 1 for n in lens))
    slots, pages = [sess.slots[r] for r in rids], [sess.pages[r] for r in rids]
    graphs.run(key, torch.randint(10, vocab, (b,), generator=gen).tolist(), lens, slots, pages)  # captures
    return graphs.graphs[key][0], touched, (sess, graphs)


def profile_batch(model, b: int, ctx: int, args) -> dict:
    graph, touched, _keep = capture_step(model, b, ctx)
    rep = replay_ms(graph, warm_s=args.warm_s)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = {k: v / args.reps for k, v in kernel_us(prof).items()}
    launches = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / args.reps
    if args.trace:
        print_trace(prof, args.reps, f"batch {b}")
    return {"batch": b, "context": ctx, "replay_ms": rep, "graph_kernels_ms": sum(kernels.values()) / 1e3,
            "kernels_per_step": launches, "experts_touched": touched,
            "kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def print_trace(prof, reps: int, label: str) -> None:
    """The kernels of the last replay in the order they ran: start, device µs and the idle gap
    before each (a graph's dependent launches wait on the one before)."""
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    one = ev[len(ev) - len(ev) // reps:]
    t0, end, busy = one[0].time_range.start, one[0].time_range.start, 0.0
    print(f"  trace of one replay, {label}: {len(one)} kernels")
    print(f"  {'#':>3} {'start':>7} {'µs':>6} {'gap':>5}  kernel")
    for i, e in enumerate(one):
        gap = max(0.0, e.time_range.start - end)
        print(f"  {i:>3} {e.time_range.start - t0:>7.1f} {e.device_time:>6.1f} {gap:>5.1f}  {e.name[:90]}")
        end, busy = max(end, e.time_range.end), busy + e.device_time
    print(f"  span {end - t0:.1f} µs, kernels {busy:.1f} µs, gaps {end - t0 - busy:.1f} µs", flush=True)


def _floor(model, b: int, ctx: int, experts_touched: int | None = None, tbps: float = CEILING_TBPS) -> float:
    """bench.decode_overlap.floor_ms without an Engine: the same byte count."""
    from glmrt.cache.layout import CacheLayout
    from bench.decode_overlap import floor_ms

    class _E:  # the two attributes floor_ms reads
        pass
    e = _E()
    e.model, e.model_config = model, model.config
    e.layout = CacheLayout.from_config(model.config.text, page_size=64, kv_dtype="bfloat16", model_dtype="bfloat16")
    return floor_ms(e, b, ctx, tbps=tbps, experts_touched=experts_touched)


def interleaved(args, cfg) -> list[dict]:
    """Every (weights, batch, variant) step captured first, all models on the GPU at once, then
    replayed in turn for args.interleave rounds: clock and thermal drift hit every row alike, and
    bf16 / fp8 is a ratio of paired rounds (separate runs of the same step differ by up to 3%).
    A variant is one value of each side-by-side axis (--moe-tile, --kda-tile, --pdl-max-tokens,
    --moe-quant, --side-stream-max-tokens, --kda-decode-gate, --mla-split),
    set while its step is captured."""
    import statistics

    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import fused_moe as fm
    from backends.kernels import fused_moe_configs as fmc
    from backends.kernels import kda, pdl, sparse_mla
    from glmrt.model.loader import load_dummy

    def setter(obj, attr, parse):
        default = getattr(obj, attr)
        return lambda v: setattr(obj, attr, default if v is None or v == "table" else parse(v))

    axes = {  # name: (values, set(value); set(None) restores the default)
        "moe_tile": (args.moe_tile, setter(fmc, "OVERRIDE", moe_tile)),
        "kda_tile": (args.kda_tile, setter(kda, "DECODE_LAUNCH", kda_launch)),
        "pdl_max": (args.pdl_max_tokens, setter(pdl, "MAX_TOKENS", int)),
        "moe_quant": (args.moe_quant, moe_quant_setter(fm)),
        "side_max": (args.side_stream_max_tokens, setter(CudaH200Ops, "SIDE_STREAM_MAX_TOKENS", int)),
        "kda_gate": (args.kda_decode_gate, setter(kda, "DECODE_GATE_IN_KERNEL", kda_gate_place)),
        "mla_split": (args.mla_split, setter(sparse_mla, "SPLIT_BY_COUNT", mla_split)),
    }
    tbps = measured_copy_tbps()  # this device's copy rate (before the models take the memory)
    torch.cuda.empty_cache()
    steps, keep = {}, []
    for quant in args.quantization.split(","):
        model = load_dummy(cfg, CudaH200Ops(), dtype=torch.bfloat16, device="cuda", with_mtp=False,
                           with_vision=False, quantization=None if quant == "bf16" else quant)
        if quant != "bf16":
            model.ops.fp8_activations = args.fp8_act.split(",")[0]
        for b in (int(x) for x in args.batches.split(",")):
            for variant in itertools.product(*(vals.split(",") for vals, _ in axes.values())):
                for v, (_, put) in zip(variant, axes.values()):
                    put(v)
                graph, touched, alive = capture_step(model, b, args.context)
                for _, put in axes.values():
                    put(None)
                steps[(quant, b, variant)] = (graph, touched, model)
                keep.append(alive)
    times = {k: [] for k in steps}
    for _ in range(args.interleave):
        for k, (graph, _, _) in steps.items():
            times[k].append(replay_ms(graph))
    rows = []
    for (quant, b, variant), (graph, touched, model) in steps.items():
        ts = times[(quant, b, variant)]
        row = dict(weights=quant, batch=b, **dict(zip(axes, variant)), rounds=len(ts),
                   median_ms=statistics.median(ts),
                   min_ms=min(ts), max_ms=max(ts), experts_touched=touched, floor_ms=_floor(model, b, args.context),
                   floor_routed_ms=_floor(model, b, args.context, touched), device_tbps=tbps,
                   floor_device_ms=_floor(model, b, args.context, touched, tbps))
        if quant != "bf16" and ("bf16", b, variant) in times:
            row["bf16_over_this"] = statistics.median(a / c for a, c in zip(times[("bf16", b, variant)], ts))
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_out("decode_profile.json", rows)
    print(f"\ndecode step replay, interleaved ({args.interleave} rounds), {args.preset} cuda-h200 on "
          f"{torch.cuda.get_device_name()}, context {args.context}")
    print(f"routed floor: the step's bytes over {CEILING_TBPS} TB/s (the H200's copy rate); device floor: "
          f"over this device's, measured in this run: {tbps:.2f} TB/s")
    print(f"{'weights':>7} {'batch':>5} {'moe tile':>28} {'kda tile':>8} {'pdl max':>7} {'moe quant':>9} {'side':>5} "
          f"{'kda gate':>8} {'mla split':>9} "
          f"{'median ms':>9} {'min':>7} {'max':>7} "
          f"{'routed floor':>12} {'/routed':>7} {'device floor':>12} {'/device':>7} {'bf16/this (paired)':>18}")
    for r in rows:
        print(f"{r['weights']:>7} {r['batch']:>5} {r['moe_tile'][:28]:>28} {r['kda_tile']:>8} "
              f"{r['pdl_max']:>7} {r['moe_quant']:>9} {r['side_max']:>5} {r['kda_gate']:>8} {r['mla_split']:>9} "
              f"{r['median_ms']:>9.3f} {r['min_ms']:>7.3f} "
              f"{r['max_ms']:>7.3f} "
              f"{r['floor_routed_ms']:>12.3f} {r['median_ms'] / r['floor_routed_ms']:>7.2f} "
              f"{r['floor_device_ms']:>12.3f} {r['median_ms'] / r['floor_device_ms']:>7.2f} "
              f"{r.get('bf16_over_this', float('nan')):>18.3f}")
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--quantization", default="bf16,fp8", help="weight formats, one model each, in one run")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--fused-small-ops", default="on",
                   help="CudaH200Ops.fused_small_ops settings to run side by side (router, KDA gate, gated norm)")
    p.add_argument("--pdl", default="on",
                   help="programmatic dependent launch of the Triton kernels: off,on side by side")
    p.add_argument("--skinny", default="measured",
                   help="CudaH200Ops.skinny_linear (16-bit decode linears on Triton, not cuBLAS): "
                        "off,measured,all side by side")
    p.add_argument("--pdl-max-tokens", default="1",
                   help="pdl.MAX_TOKENS (PDL only for forwards of up to this many tokens), side by side (with "
                        "--interleave too)")
    p.add_argument("--mhc-precision", default="tf32x3", help="mhc.DECODE_PRECISION: ieee,tf32x3 side by side")
    p.add_argument("--align", default="parallel",
                   help="moe_align.SMALL_ALIGN_MODE (the decode MoE alignment): parallel,one-program side by side")
    p.add_argument("--kda-tile", default="table",
                   help="kda.DECODE_LAUNCH as BVxWARPSxSTAGES (table: kda.DECODE_LAUNCHES by batch), side by side "
                        "(with --interleave too)")
    p.add_argument("--moe-tile", default="table",
                   help="fused MoE tile variants side by side, as fused_moe_configs.OVERRIDE: table, or "
                        "'+'-joined GEMM.KEY=INT items (gate_up.BLOCK_N=64+down.BLOCK_N=64)")
    p.add_argument("--side-stream-max-tokens", default="table",
                   help="CudaH200Ops.SIDE_STREAM_MAX_TOKENS (a layer's independent small launches on a second "
                        "stream up to this many rows; 0: one stream), side by side (with --interleave)")
    p.add_argument("--moe-quant", default="table",
                   help="where the w8a8 MoE quantises its activations at decode sizes, side by side (with "
                        "--interleave): table (fused_moe's default), gemm (each GEMM program quantises its own "
                        "x / h tiles), act_quant (one act_quant launch each for x and h first)")
    p.add_argument("--kda-decode-gate", default="table",
                   help="where a decode step's KDA forget gate is computed, side by side (with --interleave): "
                        "table (kda.DECODE_GATE_IN_KERNEL's default), kernel (inside fla's recurrent kernel), "
                        "launch (kda_gate's own launch before it)")
    p.add_argument("--mla-split", default="table",
                   help="how a decode request's latent rows are shared by the sparse MLA's splits, side by side "
                        "(with --interleave): table (sparse_mla.SPLIT_BY_COUNT's default), count (its own row "
                        "count in equal chunks), width (chunks of the static list width)")
    p.add_argument("--fp8-act", default="dynamic",
                   help="CudaH200Ops.fp8_activations for fp8 weights: none (w8a16), dynamic (w8a8), side by side")
    p.add_argument("--trace", action="store_true",
                   help="print every kernel of one replay in order: device µs and the gap before it")
    p.add_argument("--warm-s", type=float, default=0.0,
                   help="replay each captured step back to back this long before timing it (timed right after "
                        "capture, from idle clocks, the batch-1 step reads ~8%% slower: bench/RESULTS.md)")
    p.add_argument("--interleave", type=int, default=0,
                   help="R > 0: no profile; every (weights, batch) step captured, then replayed in turn R rounds "
                        "(medians, and bf16 / fp8 of paired rounds)")
    args = p.parse_args(argv)

    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import fused_moe_configs, kda, mhc, moe_align, pdl
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy

    cfg = preset_config(args.preset)
    if not args.interleave and (args.moe_quant, args.side_stream_max_tokens, args.kda_decode_gate,
                                args.mla_split) != ("table",) * 4:
        p.error("--moe-quant, --side-stream-max-tokens, --kda-decode-gate and --mla-split are axes of "
                "--interleave runs")
    if args.interleave:
        return interleaved(args, cfg)
    rows, tbps = [], measured_copy_tbps()
    torch.cuda.empty_cache()
    for quant in args.quantization.split(","):
        model = load_dummy(cfg, CudaH200Ops(), dtype=torch.bfloat16, device="cuda", with_mtp=False,
                           with_vision=False, quantization=None if quant == "bf16" else quant)
        acts = args.fp8_act.split(",") if quant != "bf16" else ["-"]  # 16-bit weights: no activation quant
        for b, fused, pd, sk, act, mt, mp, al, kt, tile in itertools.product(
                [int(x) for x in args.batches.split(",")], *(v.split(",") for v in (
                    args.fused_small_ops, args.pdl, args.skinny)), acts,
                *(v.split(",") for v in (args.pdl_max_tokens, args.mhc_precision, args.align, args.kda_tile,
                                         args.moe_tile))):
            fused_moe_configs.OVERRIDE = moe_tile(tile)
            mhc.DECODE_PRECISION = mp
            moe_align.SMALL_ALIGN_MODE = al
            kda.DECODE_LAUNCH = kda_launch(kt)
            pdl.MAX_TOKENS = int(mt)
            model.ops.fused_small_ops = fused == "on"
            model.ops.skinny_linear = sk
            model.ops.fp8_activations = "none" if act == "-" else act
            pdl.ENABLED = pd == "on"
            if mt != "1":
                pd = f"{pd}<={mt}"
            row = dict(profile_batch(model, b, args.context, args), weights=quant, fused=fused, pdl=pd, skinny=sk,
                       act="/".join([act] + [v for v, d in ((mp, "tf32x3"), (al, "parallel"), (kt, "table"),
                                                            (tile, "table")) if v != d]))
            fused_moe_configs.OVERRIDE = None
            torch.cuda.empty_cache()  # the batch's DirectSession and graphs are gone
            row["floor_ms"] = _floor(model, b, args.context)  # uniform routing (E(1-(1-k/E)^B) experts per layer)
            row["floor_routed_ms"] = _floor(model, b, args.context, row["experts_touched"])
            row["device_tbps"] = tbps
            row["floor_device_ms"] = _floor(model, b, args.context, row["experts_touched"], tbps)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
            print("  kernels (graph, µs/step): " + ", ".join(f"{k[:40]} {v:.0f}" for k, v in
                                                          list(row["kernels_us"].items())[:args.top]), flush=True)
        del model
        torch.cuda.empty_cache()
    write_out("decode_profile.json", rows)
    first = (args.fused_small_ops.split(",")[0], args.pdl.split(",")[0], args.skinny.split(",")[0])
    base = {r["batch"]: r["replay_ms"] for r in rows
            if r["weights"] == "bf16" and r["act"] == "-" and (r["fused"], r["pdl"], r["skinny"]) == first}
    print(f"\ndecode step replay, {args.preset} cuda-h200 on {torch.cuda.get_device_name()}, context {args.context}")
    print(f"floor: uniform routing (E(1-(1-k/E)^B) experts per layer); routed: the experts this step reached; "
          f"both over {CEILING_TBPS} TB/s (the H200's copy rate); device: the routed bytes over this device's, "
          f"measured in this run: {tbps:.2f} TB/s")
    print(f"{'weights':>7} {'act':>14} {'fused':>5} {'pdl':>6} {'skinny':>8} {'batch':>5} {'launches':>8} "
          f"{'replay ms':>9} "
          f"{'kernels ms':>10} {'floor ms':>8} {'/floor':>6} "
          f"{'experts':>7} {'routed floor':>12} {'/routed':>7} {'/device':>7} {'base/this':>9}")
    for r in rows:
        print(f"{r['weights']:>7} {r['act']:>14} {r['fused']:>5} {r['pdl']:>6} {r['skinny']:>8} {r['batch']:>5} "
              f"{r['kernels_per_step']:>8.0f} {r['replay_ms']:>9.3f} {r['graph_kernels_ms']:>10.3f} "
              f"{r['floor_ms']:>8.3f} {r['replay_ms'] / r['floor_ms']:>6.2f} {r['experts_touched']:>7} "
              f"{r['floor_routed_ms']:>12.3f} {r['replay_ms'] / r['floor_routed_ms']:>7.2f} "
              f"{r['replay_ms'] / r['floor_device_ms']:>7.2f} "
              f"{base.get(r['batch'], float('nan')) / r['replay_ms']:>9.2f}")
    return rows


if __name__ == "__main__":
    main()
