"""Whole-model prefill on one GPU: achieved FLOP rate over the bf16 ceiling, and transformers beside it.

    python3 -m bench.prefill_model [--preset flash-4l] [--tokens 4096,16384] [--hf-tokens 4096]

One request of T prompt tokens through the model in one forward (DirectSession, cache
written, last-token logits), with the `cuda-h200` kernel set: DSA prefill on the reference
(`--dsa-prefill-backend torch`) and on the per-token kernels (`triton`). The FLOPs counted are
the useful ones: 2 x T x the parameters a token multiplies (non-expert weights, the shared
expert, k/E of the routed experts; the LM head once), the sparse attention over the selected
tokens (non-absorbed form), the indexer over the completed pools, and the KDA recurrence
(4 dk dv per head and token). transformers 5.17.0 runs the same weights at `--hf-tokens`.
Prints a short table last; JSON to $OUT/prefill_model.json when OUT is set.
"""

from __future__ import annotations

import argparse
import torch

from bench.h200 import CEILING_TFLOPS, measured_matmul_tflops, write_out
from bench.timing import as_engine_threads, event_ms, host_time, kernel_us



def useful_flops(model, t: int) -> dict[str, float]:
    cfg = model.config.text
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    exp_params = sum(p.numel() for m in experts for p in m.parameters())
    head = model.lm_head.weight.numel()
    embed = model.model.embed_tokens.weight.numel()
    dense = sum(p.numel() for p in model.model.layers.parameters()) - exp_params
    active = dense + exp_params * cfg.num_experts_per_tok / cfg.n_routed_experts
    out = {"weights": 2.0 * t * active + 2.0 * head, "embed_params": float(embed)}
    n_dsa = sum(1 for x in cfg.layer_types if x == "deepseek_sparse_attention")
    n_kda = cfg.num_hidden_layers - n_dsa
    sel = cfg.index_topk + cfg.index_kpool - 1
    att = sum(min(i + 1, sel) for i in range(t))
    out["sparse_attention"] = n_dsa * 2.0 * att * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                              + cfg.v_head_dim)
    pools = sum((i + 1) // cfg.index_kpool for i in range(t))
    out["indexer"] = n_dsa * 2.0 * pools * cfg.index_n_heads * cfg.index_head_dim
    out["kda"] = n_kda * 4.0 * t * cfg.linear_num_heads * cfg.linear_head_dim ** 2
    out["total"] = out["weights"] + out["sparse_attention"] + out["indexer"] + out["kda"]
    return out


def _time_ms(fn, reps: int) -> float:
    if not torch.cuda.is_available() or reps == 0:  # the CPU smoke run, or one untimed call
        fn()
        return float("nan")
    return event_ms(fn, reps)


def ours_prefill_ms(model, prompt: torch.Tensor, reps: int,
                    host_top: int = 0) -> tuple[float, torch.Tensor, dict | None]:
    """Event-timed median of `reps` prefills of `prompt` (one new request each, one session's pools)
    -> (ms, the last logits, with `host_top` host_time's result over more of the same forwards)."""
    from glmrt.model.session import DirectSession

    t = prompt.numel()
    sess = DirectSession(model, max_requests=1, max_tokens=t + 64, page_size=64, shuffle_pages=False)
    last = {}

    def run():
        rid = sess.new_request()
        with torch.no_grad():
            last["logits"] = sess.step({rid: prompt}, all_logits=False)[rid]
        sess.release(rid)
    ms = _time_ms(run, reps)
    host = host_time(run, top=host_top) if host_top else None
    logits = last["logits"].float().reshape(-1)
    sess.cache = None  # free the pools before the next configuration
    torch.cuda.empty_cache()
    return ms, logits, host


_HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
               "cudaMemcpy", "aten::_local_scalar_dense", "aten::nonzero", "aten::item")


def profile_prefill(model, prompt: torch.Tensor) -> tuple[dict[str, float], dict[str, tuple[int, float]]]:
    """One prefill forward under the profiler (after the timed ones: nothing compiles) ->
    (device ms per kernel name, {host call that waits for the GPU or copies: (count, host ms)})
    — the second says where the GPU idles between kernels."""
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        ours_prefill_ms(model, prompt, 0)
        torch.cuda.synchronize()
    host: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name in _HOST_WAITS:
            c, ms = host.get(e.name, (0, 0.0))
            host[e.name] = (c + 1, ms + e.cpu_time_total / 1e3)
    return {k: v / 1e3 for k, v in kernel_us(prof).items()}, host


def as_int_or_name(value: str) -> int | str:
    """A side-by-side axis value: a number (a size) or a name (a kernel)."""
    return int(value) if value.isdigit() else value


def on_off(v: str) -> bool:
    if v not in ("on", "off"):
        raise SystemExit(f"expected on or off, not {v!r}")
    return v == "on"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--hf-tokens", default="4096", help="lengths transformers also runs ('' for none)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dsa", default="torch,triton", help="DSA prefill backends: torch, triton (the kernels on "
                   "packed row lists, sparse_mla's default), triton-kernel (rows derived inside the attention "
                   "kernel); the torch reference expands [H, T, T] scores: it does not fit at 16K in one forward")
    p.add_argument("--mla-chunk-rows", default="", help="sparse_mla_prefill.PREFILL_CHUNK_ROWS values (query tokens per "
                   "sparse-MLA prefill launch) also timed on the triton backend, e.g. 4096,16384")
    p.add_argument("--mhc-mix-k", default="", help="mhc.PREFILL_MIX_K values also timed on the triton backend, "
                   "e.g. 0,2048 (0: mhc_pre's one-launch path from ~8.4K tokens)")
    p.add_argument("--mla-prefill-kernel", default="", help="sparse_mla_prefill.PREFILL_KERNEL values also timed on the "
                   "triton backend, e.g. triton,sm90")
    p.add_argument("--moe-tile", default="", help="fused MoE tile variants also timed on the triton backend, "
                   "','-separated, each 'table' or '+'-joined GEMM.KEY=INT items as in bench.decode_profile "
                   "(BLOCK_M=64+gate_up.BLOCK_N=64)")
    p.add_argument("--kda-safe-gate", default="", help="kda.SAFE_GATE values also timed on the triton backend, "
                   "e.g. off,on (chunk_kda's bounded-gate path)")
    p.add_argument("--kda-gate-in-kernel", default="", help="kda.GATE_IN_KERNEL values also timed on the triton "
                   "backend, e.g. off,on (the forget gate computed inside chunk_kda)")
    p.add_argument("--mhc-norm-chunk", default="", help="mhc.NORM_CHUNK values also timed on the triton backend, "
                   "e.g. 0,2048 (0: mhc_pre's input norm on the whole row in one tile)")
    p.add_argument("--moe-grouped-min-tokens", default="", help="CudaH200Ops.GROUPED_MIN_TOKENS values also timed "
                   "on the triton backend, e.g. off,4096 (off: the fused MoE's Triton GEMMs at every size)")
    p.add_argument("--profile", type=int, default=0, help="print the N largest kernels of one profiled forward")
    p.add_argument("--host-time", type=int, default=0, metavar="N",
                   help="time the forward on the host clock (until it returns, until the GPU is done) and "
                        "print the N functions with the most host time of one forward (cProfile)")
    p.add_argument("--quantization", default="bf16", help="weights: bf16 or fp8 (block-scaled e4m3, dummy)")
    p.add_argument("--fp8-act-max-tokens", default="",
                   help="CudaH200Ops.fp8_act_max_tokens: w8a8 for calls of up to N tokens, 'all' for every size "
                        "(default: the ops' own, every size), 'none' for w8a16 everywhere")
    args = p.parse_args(argv)
    as_engine_threads()  # host work timed as an engine actor does it

    from backends.cuda_h200 import CudaH200Ops
    from backends.kernels import mhc
    from backends.kernels import fused_moe_configs as fmc
    from backends.kernels import sparse_mla_prefill as smp
    from backends.kernels import kda as kk
    from bench.decode_profile import moe_tile
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy

    cfg = preset_config(args.preset)
    ops = CudaH200Ops()
    if args.fp8_act_max_tokens == "none":
        ops.fp8_activations = "none"
    elif args.fp8_act_max_tokens:
        ops.fp8_act_max_tokens = None if args.fp8_act_max_tokens == "all" else int(args.fp8_act_max_tokens)
    hf_lens = {int(x) for x in args.hf_tokens.split(",") if x}
    if hf_lens and args.quantization != "bf16":
        print("transformers runs bf16 weights only here: --hf-tokens ignored for", args.quantization, flush=True)
        hf_lens = set()
    model = load_dummy(cfg, ops, dtype=torch.bfloat16, device="cuda", with_mtp=False, with_vision=bool(hf_lens),
                       quantization=None if args.quantization == "bf16" else args.quantization)
    hf = None
    if hf_lens:
        from bench.hf_reference import build_hf_from_ours
        hf = build_hf_from_ours(model, "cuda", torch.bfloat16)
    rows = []
    for t in [int(x) for x in args.tokens.split(",")]:
        prompt = torch.randint(10, cfg.text.vocab_size - 100, (t,), generator=torch.Generator().manual_seed(t))
        fl = useful_flops(model, t)
        row = {"tokens": t, "tflop": fl["total"] / 1e12, "flops": fl}
        got = {}
        for name, kernels in (("torch", False), ("triton", True), ("triton-kernel", True)):
            if name not in args.dsa.split(","):
                row[f"{name}_ms"], got[name] = float("nan"), None
                continue
            ops.prefill_kernels = kernels
            smp.PREFILL_TOKEN_LIST = "kernel" if name == "triton-kernel" else "precomputed"
            row[f"{name}_ms"], got[name], ht = ours_prefill_ms(model, prompt.cuda(), args.reps,
                                                               host_top=args.host_time)
            print(name, t, f"{row[f'{name}_ms']:.1f} ms", flush=True)
            # each axis: its values, the setting they go to, and how a value is read
            for values, mod, attr, key, what, parse in (
                    (args.mla_chunk_rows, smp, "PREFILL_CHUNK_ROWS", "chunk", "sparse-MLA prefill in launches of {} "
                                                                             "query tokens", as_int_or_name),
                    (args.mhc_mix_k, mhc, "PREFILL_MIX_K", "mhc_mix_k", "mhc_pre mixing K in pieces of {} "
                                                                        "(0: one launch from ~8.4K tokens)",
                     as_int_or_name),
                    (args.mla_prefill_kernel, smp, "PREFILL_KERNEL", "mla_kernel", "sparse-MLA prefill on the {} "
                                                                                  "kernel", as_int_or_name),
                    (args.moe_tile, fmc, "OVERRIDE", "moe_tile", "MoE tiles {}", moe_tile),
                    (args.kda_safe_gate, kk, "SAFE_GATE", "kda_safe_gate", "chunk_kda's safe gate {}", on_off),
                    (args.kda_gate_in_kernel, kk, "GATE_IN_KERNEL", "kda_gate_in_kernel",
                     "the KDA gate inside chunk_kda {}", on_off),
                    (args.mhc_norm_chunk, mhc, "NORM_CHUNK", "mhc_norm_chunk", "mhc_pre's input norm in chunks of {}",
                     as_int_or_name),
                    (args.moe_grouped_min_tokens, CudaH200Ops, "GROUPED_MIN_TOKENS", "moe_grouped",
                     "16-bit experts on grouped GEMMs from {} tokens", lambda v: None if v == "off" else int(v))):
                if name != "triton" or not values:
                    continue
                keep = getattr(mod, attr)
                try:
                    for v in [x.strip() for x in values.split(",")]:
                        setattr(mod, attr, parse(v))
                        ms, logits, _ = ours_prefill_ms(model, prompt.cuda(), args.reps)
                        row[f"triton_ms_{key}{v}"] = ms
                        diff = float((logits - got["triton"]).norm() / got["triton"].norm())
                        print(f"triton {t}, {what.format(v)}: {ms:.1f} ms "
                              f"({100 * fl['total'] / (ms / 1e3) / 1e12 / CEILING_TFLOPS:.1f}% of the ceiling; "
                              f"logits rel {diff:.1e} against the run above)", flush=True)
                finally:
                    setattr(mod, attr, keep)
            if ht is not None:
                row[f"{name}_host"] = ht
                print(f"  host: the forward returns after {ht['host_ms']:.1f} ms, the GPU is done after "
                      f"{ht['wall_ms']:.1f} ms; most host time (own ms): " + ", ".join(
                          f"{where} {own:.1f}" for own, _, _, where in ht["top"]), flush=True)
            if args.profile and torch.cuda.is_available():
                row[f"{name}_kernels_ms"], host = profile_prefill(model, prompt.cuda())
                total = sum(row[f"{name}_kernels_ms"].values())
                print("  host calls that wait for the GPU or copy (count, ms): " + ", ".join(
                    f"{k} {c} {ms:.1f}" for k, (c, ms) in host.items()), flush=True)
                print(f"  kernels ({total:.1f} ms in all): " + ", ".join(
                    f"{k[:48]} {v:.1f} ({100 * v / total:.0f}%)"
                    for k, v in list(row[f"{name}_kernels_ms"].items())[:args.profile]), flush=True)
        ops.prefill_kernels, smp.PREFILL_TOKEN_LIST = False, "precomputed"
        a, b, c = got["torch"], got["triton"], got["triton-kernel"]
        if a is not None and b is not None:
            row["triton_vs_torch_rel"] = float((a - b).norm() / a.norm())
            row["same_argmax"] = bool(a.argmax() == b.argmax())
        if b is not None and c is not None:
            row["kernel_vs_triton_rel"] = float((c - b).norm() / b.norm())
        a = next((x for x in (a, b, c) if x is not None), None)
        if hf is not None and t in hf_lens:
            ids = prompt.cuda()[None]
            with torch.no_grad():
                hl = {}

                def hf_run():
                    hl["x"] = hf(input_ids=ids, use_cache=True, logits_to_keep=1).logits
                row["hf_ms"] = _time_ms(hf_run, args.reps)
                h = hl["x"].float().reshape(-1)
                row["hf_vs_ours_rel"] = float((h - a).norm() / h.norm())
            torch.cuda.empty_cache()
        rows.append(row)
    act = "" if args.quantization == "bf16" else f" (w8a8 up to {ops.fp8_act_max_tokens or 'any'} tokens)" \
        if ops.fp8_activations == "dynamic" else " (w8a16)"
    print(f"\nprefill, {args.preset} {args.quantization}{act} on {torch.cuda.get_device_name()}, one request; "
          f"ceiling {CEILING_TFLOPS} TFLOP/s (bf16)")
    print(f"{'tokens':>6} {'TFLOP':>6} {'torch ms':>9} {'%ceil':>6} {'triton ms':>10} {'%ceil':>6} {'kern ms':>8} "
          f"{'%ceil':>6} {'HF ms':>8} {'HF/ours':>8} {'tri~torch rel':>13} {'kern~tri rel':>12} {'HF~ours rel':>11}")
    nan = float("nan")
    for r in rows:
        best = min([x for x in (r["torch_ms"], r["triton_ms"], r["triton-kernel_ms"]) if x == x] or [nan])
        pc = lambda ms: 100 * r["tflop"] / (ms / 1e3) / CEILING_TFLOPS  # noqa: E731
        hf_ms, pre = r.get("hf_ms", nan), r["triton-kernel_ms"]
        print(f"{r['tokens']:>6} {r['tflop']:>6.2f} {r['torch_ms']:>9.1f} {pc(r['torch_ms']):>5.1f}% {r['triton_ms']:>10.1f} "
              f"{pc(r['triton_ms']):>5.1f}% {pre:>8.1f} {pc(pre):>5.1f}% {hf_ms:>8.1f} {hf_ms / best:>8.1f} "
              f"{r.get('triton_vs_torch_rel', nan):>13.2e} {r.get('kernel_vs_triton_rel', nan):>12.2e} "
              f"{r.get('hf_vs_ours_rel', nan):>11.2e}")
    device_tflops = measured_matmul_tflops()
    for r in rows:
        r["device_tflops"] = device_tflops
    write_out("prefill_model.json", rows)
    print(f"this device's bf16 8192^3 matmul, measured in this run: {device_tflops:.0f} TFLOP/s; against it: " + ", ".join(
        f"{r['tokens']} tokens {name} {100 * r['tflop'] / (r[key] / 1e3) / device_tflops:.1f}%"
        for r in rows for name, key in (("triton", "triton_ms"), ("kern", "triton-kernel_ms")) if r[key] == r[key]))
    return rows


if __name__ == "__main__":
    main()
