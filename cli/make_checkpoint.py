"""`glmrt make-checkpoint`: write a random-weight checkpoint of a preset, or print its sizes."""

from __future__ import annotations

import argparse
import os
import sys

from glmrt.engine.config import EngineConfig
from glmrt.engine.fit import H200_GPU_MEMORY_GB

GIB = 2**30


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-checkpoint", help="write a random-weight GLM-5.3-Flash checkpoint in HF format",
        description="Write config.json, safetensors weights, generation_config.json and a real tokenizer "
                    "for a preset shape with random weights, or print its sizes with --meta.")
    p.add_argument("--preset", help="tiny | tiny-trained | flash-4l | flash-4l-mtp | flash (random weights)")
    p.add_argument("--from", dest="from_dir", metavar="DIR",
                   help="instead of a preset: DIR's own weights (an unquantised checkpoint, e.g. one `glmrt train` "
                        "wrote), re-written in --dtype (fp8: block-scaled e4m3, since glmrt never quantises on load)")
    p.add_argument("--out", help="output directory (required unless --meta)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "fp8", "mxfp4", "nvfp4"],
                   help="weight dtype; fp8 writes e4m3 weights with 128x128 block scales; mxfp4 (Quark export) "
                        "and nvfp4 (ModelOpt export) pack the MLP and expert weights to e2m1, the rest bf16")
    p.add_argument("--layout", default="nested", choices=["nested", "flat"],
                   help="key layout: nested (model.language_model.*, as HF writes) or flat (model.layers.*)")
    p.add_argument("--shard-size-gb", type=float, default=4.0)
    p.add_argument("--meta", action="store_true", help="print parameter and per-request cache sizes, write nothing")
    p.add_argument("--force", action="store_true", help="allow writing the large presets (flash-4l, flash-4l-mtp, flash)")
    p.add_argument("--no-weights", action="store_true",
                   help="write config.json, generation_config.json and the tokenizer only (for --load-format dummy)")
    g = p.add_argument_group("per-GPU memory plan (printed with the sizes: what one rank of an engine holds)")
    g.add_argument("--tp-size", "--tp", type=int, default=1, dest="tp_size", help="tensor-parallel ranks (default 1)")
    g.add_argument("--ep-size", "--ep", type=int, default=1, dest="ep_size",
                   help="expert-parallel degree: 1 or --tp-size (default 1)")
    g.add_argument("--gpu-memory-gb", type=float, default=H200_GPU_MEMORY_GB,
                   help=f"memory of one GPU in GB (10^9 bytes; default {H200_GPU_MEMORY_GB:g}, the H200's)")
    g.add_argument("--quantization", choices=["fp8"],
                   help="plan for weights quantised to fp8 on load (--load-format dummy --quantization fp8); "
                        "--dtype fp8 plans for an fp8 checkpoint alike")
    g.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"],
                   help="KV cache dtype (default bfloat16, cuda-h200's)")
    for name, kind in (("mamba_ssm_dtype", str), ("mem_fraction_static", float), ("mamba_full_memory_ratio", float),
                       ("max_mamba_cache_size", int), ("max_running_requests", int), ("context_length", int),
                       ("page_size", int)):
        default = getattr(EngineConfig(), name)
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                       help=f"as glmrt up's (default {default})")
    p.set_defaults(func=run)


def _param_breakdown(config) -> dict[str, int]:
    import torch

    from glmrt.model.glm5_next import Glm5NextForCausalLM
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, None, torch.bfloat16)
    out = {"routed experts": 0, "other text": 0, "embed + lm_head": 0, "vision": 0, "mtp layer": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("visual."):
            out["vision"] += n
        elif name.startswith("mtp."):
            out["mtp layer"] += n
        elif name.startswith(("lm_head", "model.embed_tokens")):
            out["embed + lm_head"] += n
        elif ".mlp.experts." in name:
            out["routed experts"] += n
        else:
            out["other text"] += n
    return out


def print_meta(preset: str, config, dtype: str) -> None:
    from glmrt.cache.layout import CacheLayout
    from glmrt.checkpoint.writer import checkpoint_bytes

    t = config.text
    parts = _param_breakdown(config)
    total = sum(parts.values())
    print(f"preset {preset}: {t.num_hidden_layers} layers ({len(t.kda_layers)} KDA, {len(t.dsa_layers)} DSA; "
          f"{sum(t.is_moe(i) for i in range(t.num_hidden_layers))} MoE), hidden {t.hidden_size}, "
          f"{t.n_routed_experts} experts top-{t.num_experts_per_tok}, vocab {t.vocab_size}, "
          f"MTP layers {t.num_nextn_predict_layers}")
    print("parameters:")
    for k, v in parts.items():
        print(f"  {k:<16} {v / 1e9:10.3f} B")
    print(f"  {'total':<16} {total / 1e9:10.3f} B")
    active_experts = t.num_experts_per_tok * t.moe_intermediate_size * 3 * t.hidden_size * \
        sum(t.is_moe(i) for i in range(t.num_hidden_layers))
    active = total - parts["routed experts"] - parts["vision"] - parts["mtp layer"] + active_experts
    print(f"  {'active / token':<16} {active / 1e9:10.3f} B (text, without vision and MTP)")
    print(f"checkpoint size ({dtype}): {checkpoint_bytes(config, dtype) / GIB:.2f} GiB")
    print("cache per request (KV for the context + one state slot; docs/MODEL.md §8):")
    combos = [("bf16 KV + fp32 state", "bfloat16", "float32"), ("fp8 KV + bf16 state", "fp8_e4m3", "bfloat16"),
              ("fp8 KV + fp32 state", "fp8_e4m3", "float32")]
    layouts = [(label, CacheLayout.from_config(t, page_size=max(64, t.index_kpool), kv_dtype=kv, state_dtype=st))
               for label, kv, st in combos]
    print(f"  {'context':>10} " + " ".join(f"{label:>22}" for label, _ in layouts))
    for n in (1024, 8192, 32768, 131072, 1048576):
        print(f"  {n:>10,} " + " ".join(f"{lay.request_bytes(n) / 2**20:>18.1f} MiB" for _, lay in layouts))
    lay = layouts[0][1]
    print(f"  KV bytes/token {lay.kv_bytes_per_token:,.2f} (bf16); state bytes/slot {lay.state_bytes_per_slot:,} "
          f"(conv {lay.conv_bytes_per_slot:,}, recurrent {lay.recurrent_bytes_per_slot:,}, "
          f"indexer tail {lay.tail_bytes_per_slot:,})")


def fit_plan(config, args: argparse.Namespace):
    """The memory plan of one rank of an engine serving this preset (glmrt.engine.fit)."""
    from glmrt.engine.fit import GB, engine_fit

    fp8 = args.dtype == "fp8" or args.quantization == "fp8"
    cfg = EngineConfig(load_format="dummy", quantization="fp8" if fp8 else None, kv_cache_dtype=args.kv_cache_dtype,
                       mamba_ssm_dtype=args.mamba_ssm_dtype, mem_fraction_static=args.mem_fraction_static,
                       mamba_full_memory_ratio=args.mamba_full_memory_ratio,
                       max_mamba_cache_size=args.max_mamba_cache_size,
                       max_running_requests=args.max_running_requests, context_length=args.context_length,
                       page_size=args.page_size)
    model_dtype = "float32" if args.dtype == "float32" else "bfloat16"  # fp4 checkpoints load dequantised
    return engine_fit(config, cfg, gpu_bytes=int(args.gpu_memory_gb * GB), kv_dtype=args.kv_cache_dtype,
                      model_dtype=model_dtype, tp_size=args.tp_size, ep_size=args.ep_size)


def print_fit(plan, args: argparse.Namespace) -> None:
    weights = "fp8" if args.dtype == "fp8" or args.quantization == "fp8" else \
        ("float32" if args.dtype == "float32" else "bfloat16")
    print(f"per GPU at tp {args.tp_size}, ep {args.ep_size} ({weights} weights, {args.kv_cache_dtype} KV, "
          f"{args.mamba_ssm_dtype} state, mem_fraction_static {args.mem_fraction_static}, "
          f"{args.gpu_memory_gb:g} GB GPU; without the MTP layer, as glmrt up loads it):")
    for line in plan.describe().splitlines():
        print("  " + line)


def convert(args: argparse.Namespace) -> int:
    from glmrt.checkpoint.convert import convert_checkpoint

    src = os.path.abspath(os.path.expanduser(args.from_dir))
    if args.preset is not None or args.meta or args.no_weights:
        print("error: --from takes its shape from DIR: no --preset, --meta or --no-weights with it", file=sys.stderr)
        return 2
    if not args.out:
        print("error: --out DIR is required", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(src, "config.json")):
        print(f"error: no config.json in {src}", file=sys.stderr)
        return 2
    out = os.path.abspath(os.path.expanduser(args.out))
    if out == src:
        print("error: --out must differ from --from", file=sys.stderr)
        return 2
    try:
        summary = convert_checkpoint(src, out, args.dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {src}'s weights as {args.dtype} to {out}: {summary['tensors']} tensors, "
          f"{summary['bytes'] / 2**20:.1f} MiB")
    return 0


def run(args: argparse.Namespace) -> int:
    from glmrt.checkpoint.presets import LARGE_PRESETS, preset_config
    from glmrt.checkpoint.writer import check_disk, checkpoint_bytes, write_checkpoint

    if args.from_dir is not None:
        return convert(args)
    if args.preset is None:
        print("error: give --preset NAME (random weights) or --from DIR (a checkpoint's own weights)", file=sys.stderr)
        return 2
    try:
        config = preset_config(args.preset)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpu_memory_gb <= 0:
        print(f"error: --gpu-memory-gb must be > 0 (got {args.gpu_memory_gb})", file=sys.stderr)
        return 2
    try:
        plan = fit_plan(config, args)
    except ValueError as e:  # a bound of an engine value, or a tp / ep the model's sizes do not divide
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.meta:
        print_meta(args.preset, config, args.dtype)
        print_fit(plan, args)
        return 0
    if not args.out:
        print("error: --out DIR is required (or use --meta)", file=sys.stderr)
        return 2
    if args.no_weights:
        import json

        from glmrt.checkpoint.tokenizer import write_tokenizer
        from glmrt.checkpoint.writer import checkpoint_config, generation_config
        out = os.path.abspath(os.path.expanduser(args.out))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump(checkpoint_config(config, args.dtype).to_dict(), f, indent=2)
        with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(generation_config(config), f, indent=2)
        write_tokenizer(out, config.text.vocab_size)
        print(f"wrote {args.preset} config and tokenizer (no weights) to {out}: serve it with --load-format dummy")
        return 0
    need = checkpoint_bytes(config, args.dtype)
    if args.preset in LARGE_PRESETS and not args.force:
        print(f"error: preset {args.preset} is {need / GIB:.1f} GiB in {args.dtype}; pass --force to write it "
              f"(or use --load-format dummy to build it in device memory without files)", file=sys.stderr)
        return 2
    try:
        check_disk(args.out, need)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(os.path.expanduser(args.out))
    summary = write_checkpoint(config, out, seed=args.seed, dtype=args.dtype,
                               shard_bytes=int(args.shard_size_gb * GIB), layout=args.layout)
    print(f"wrote {args.preset} ({args.dtype}, seed {args.seed}) to {out}: {summary['tensors']} tensors, "
          f"{summary['bytes'] / 2**20:.1f} MiB in {summary['shards']} shard(s)")
    print_meta(args.preset, config, args.dtype)
    print_fit(plan, args)
    return 0
