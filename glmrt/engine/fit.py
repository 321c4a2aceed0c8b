"""Will a deployment fit: one GPU's memory, per rank, before any weight is loaded.

    GPU memory = weights (this rank's shard) + runtime reserve + activation reserve + cache pools
    cache pools = (GPU memory - weights - runtime reserve) * mem_fraction_static

which is how the engine sizes its pools (glmrt.engine.engine `_cache_budget`: the free memory
after loading times `--mem-fraction-static`), with the free memory predicted instead of measured.
The pools are then carved by `plan_memory`, the engine's own function, so the pages, slots and
running requests printed here are the ones the engine will have (up to the runtime reserve,
an estimate).

- weights: exactly what one rank's shard holds: the model is built on the meta device for each
  rank of the group (`build_model(..., parallel=Parallel(rank, tp, ep))`, no collectives are
  needed to build) and its parameter bytes summed; the largest rank counts. As the engine loads
  it: without the MTP layer, with the vision tower unless a vision actor runs it; FP8 weights
  (a `--quantization fp8` dummy model or an FP8 checkpoint) convert the linear layers
  `default_fp8_modules` names, MXFP4 / NVFP4 checkpoints load dequantised to the model dtype.
- runtime reserve: 1 GiB for what lives outside torch's allocator and so is not free when the
  engine measures (the CUDA context, cuBLAS and NCCL workspaces).
- activation reserve: the (1 - mem_fraction_static) share of the free memory the engine leaves
  to activations, CUDA graphs and kernel workspaces.

`plan_fit` is torch-free; `shard_weight_bytes` imports torch (the meta device only, seconds
for the full model). `glmrt up` runs `python -m glmrt.engine.fit` in a child interpreter (it
never imports torch itself) with the free memory nvidia-smi reports; each engine rank runs
`check_engine_fits` for its own shard with `torch.cuda.mem_get_info` before it loads its weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from glmrt.cache.layout import CacheLayout
from glmrt.engine.memory import MemoryPlan, draft_kv_bytes, plan_memory

GB = 10**9
GIB = 2**30
H200_GPU_MEMORY_GB = 141.0   # NVIDIA's figure for the H200, in GB (10^9 bytes): 131.3 GiB
RUNTIME_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class FitPlan:
    """One rank's memory, as the engine would lay it out, and whether a request fits."""

    gpu_bytes: int               # the memory the engine may use on its GPU
    weight_bytes: int            # the largest rank's shard
    runtime_reserve: int
    activation_reserve: int
    budget_bytes: int            # the two cache pools together (0 when the weights do not fit)
    memory: MemoryPlan | None    # None when the budget holds no state slot and KV page
    context_length: int          # what one request may hold (asked, or the model's, clamped to the pool)
    refusal: str | None          # why it cannot run, one line; None when it fits

    @property
    def fits(self) -> bool:
        return self.refusal is None

    def describe(self) -> str:
        lines = [f"GPU memory:          {self.gpu_bytes / GIB:9.2f} GiB ({self.gpu_bytes / GB:.1f} GB)",
                 f"weights (per rank):  {self.weight_bytes / GIB:9.2f} GiB",
                 f"runtime reserve:     {self.runtime_reserve / GIB:9.2f} GiB (CUDA context, cuBLAS / NCCL)",
                 f"activation reserve:  {self.activation_reserve / GIB:9.2f} GiB (1 - mem_fraction_static of "
                 f"the free memory)",
                 f"cache pools:         {self.budget_bytes / GIB:9.2f} GiB"]
        if self.memory is not None:
            lines += ["  " + line for line in self.memory.describe().splitlines()]
            lines.append(f"context length:      {self.context_length:,} tokens")
        lines.append("fits" if self.fits else f"does not fit: {self.refusal}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"gpu_bytes": self.gpu_bytes, "weight_bytes": self.weight_bytes,
                "runtime_reserve_bytes": self.runtime_reserve, "activation_reserve_bytes": self.activation_reserve,
                "budget_bytes": self.budget_bytes, "context_length": self.context_length, "refusal": self.refusal,
                "memory": self.memory.as_dict() if self.memory is not None else None}


def plan_fit(layout: CacheLayout, weight_bytes: int, gpu_bytes: int, *, mem_fraction_static: float = 0.85,
             ratio: float = 0.9, max_mamba_cache_size: int | None = None, max_running_requests: int | None = None,
             context_length: int | None = None, max_position_embeddings: int,
             runtime_reserve: int = RUNTIME_RESERVE_BYTES, rollback: bool = False,
             draft_kv_bytes_per_token: float = 0.0) -> FitPlan:
    """The engine's pools on a GPU of `gpu_bytes` after `weight_bytes` of weights. A `context_length`
    asked for must fit in the KV pool; without one the engine serves what the pool holds, up to the
    model's `max_position_embeddings`."""
    free = gpu_bytes - weight_bytes - runtime_reserve
    want = context_length or max_position_embeddings

    def refused(reason: str, budget: int = 0, memory: MemoryPlan | None = None) -> FitPlan:
        return FitPlan(gpu_bytes, weight_bytes, runtime_reserve, max(free - budget, 0), budget, memory,
                       min(want, memory.kv_tokens) if memory else 0, reason)

    need = f"weights {weight_bytes / GIB:.2f} GiB + runtime reserve {runtime_reserve / GIB:.2f} GiB"
    if free <= 0:
        return refused(f"{need} exceed the GPU's {gpu_bytes / GIB:.2f} GiB")
    budget = int(free * mem_fraction_static)
    try:
        memory = plan_memory(layout, budget, ratio=ratio, max_mamba_cache_size=max_mamba_cache_size,
                             max_running_requests=max_running_requests, rollback=rollback,
                             draft_kv_bytes_per_token=draft_kv_bytes_per_token)
    except ValueError as e:
        return refused(f"{need} leave {free / GIB:.2f} GiB of the GPU's {gpu_bytes / GIB:.2f} GiB, "
                       f"x mem_fraction_static {mem_fraction_static} = {budget / GIB:.2f} GiB of cache: {e}", budget)
    if context_length is not None and memory.kv_tokens < context_length:
        return refused(f"{need} leave {budget / GIB:.2f} GiB of cache on the GPU's {gpu_bytes / GIB:.2f} GiB: a KV "
                       f"pool of {memory.kv_tokens:,} tokens, less than one request of context_length "
                       f"{context_length:,}", budget, memory)
    return FitPlan(gpu_bytes, weight_bytes, runtime_reserve, free - budget, budget, memory,
                   min(want, memory.kv_tokens), None)


def weight_format(model_config, quantization: str | None, load_format: str = "auto") -> str | None:
    """"fp8" when the engine would hold FP8 linear layers, else None (the model dtype; MXFP4 and
    NVFP4 checkpoints are dequantised to it on load)."""
    if load_format == "dummy":
        return "fp8" if quantization == "fp8" else None
    q = model_config.quantization
    scheme = None if q is None else getattr(q, "scheme", None) or getattr(q, "quant_method", None)
    return "fp8" if scheme in ("fp8", "fp8_block") else None


def shard_weight_bytes(model_config, *, dtype: str = "bfloat16", fp8: bool = False, tp_size: int = 1,
                       ep_size: int = 1, with_vision: bool = True, with_mtp: bool = False,
                       ranks: list[int] | None = None) -> int:
    """Parameter bytes of the largest shard of `ranks` (default: every rank), built on the meta device
    (no memory, no group)."""
    import torch

    from glmrt.model.loader import build_model, default_fp8_modules
    from glmrt.parallel import Parallel

    torch_dtype = getattr(torch, dtype)
    fp8_modules = default_fp8_modules(model_config, torch_dtype) if fp8 else []
    block = model_config.quantization.weight_block_size if fp8 and model_config.quantization else (128, 128)
    most = 0
    for rank in range(tp_size) if ranks is None else ranks:
        model = build_model(model_config, None, torch_dtype, "meta", fp8_modules=fp8_modules, fp8_block=block,
                            with_vision=with_vision, with_mtp=with_mtp,
                            parallel=Parallel(rank, tp_size, ep_size, None))
        seen, total = set(), 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        most = max(most, total)
    return most


def engine_fit(model_config, cfg, *, gpu_bytes: int, kv_dtype: str, model_dtype: str = "bfloat16",
               tp_size: int = 1, ep_size: int = 1, ranks: list[int] | None = None) -> FitPlan:
    """The fit of one engine (an EngineConfig) on a GPU of `gpu_bytes`: its largest shard of `ranks`
    (default: every rank)."""
    text = model_config.text
    spec = cfg.speculative_steps > 0  # the MTP layer's weights, its KV and the rollback snapshots
    weights = shard_weight_bytes(model_config, dtype=model_dtype,
                                 fp8=weight_format(model_config, cfg.quantization, cfg.load_format) == "fp8",
                                 tp_size=tp_size, ep_size=ep_size, with_vision=cfg.load_vision, with_mtp=spec,
                                 ranks=ranks)
    layout = CacheLayout.from_config(text, page_size=cfg.page_size, kv_dtype=kv_dtype,
                                     state_dtype=cfg.mamba_ssm_dtype, model_dtype=model_dtype, tp_size=tp_size,
                                     with_mtp=spec)
    return plan_fit(layout, weights, gpu_bytes, mem_fraction_static=cfg.mem_fraction_static,
                    ratio=cfg.mamba_full_memory_ratio, max_mamba_cache_size=cfg.max_mamba_cache_size,
                    max_running_requests=cfg.max_running_requests, context_length=cfg.context_length,
                    max_position_embeddings=text.max_position_embeddings, rollback=spec and cfg.role != "prefill",
                    draft_kv_bytes_per_token=draft_kv_bytes(text, kv_dtype=kv_dtype, model_dtype=model_dtype,
                                                            tp_size=tp_size) if spec else 0.0)


def check_engine_fits(cfg, *, device: str, kv_dtype: str, parallel) -> None:
    """The engine's own check, on its GPU before it loads: ValueError with the numbers when this
    rank's shard and pools do not fit in the GPU's free memory."""
    import torch

    from glmrt.checkpoint.presets import preset_config
    from glmrt.config import load_model_config

    mc = load_model_config(os.path.expanduser(cfg.model)) if cfg.model else preset_config(cfg.preset or "tiny")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    plan = engine_fit(mc, cfg, gpu_bytes=free, kv_dtype=kv_dtype, model_dtype=cfg.resolved_dtype(device),
                      tp_size=parallel.tp_size, ep_size=parallel.ep_size, ranks=[parallel.rank])
    if not plan.fits:
        raise ValueError(f"rank {parallel.rank}: the model does not fit on {device}: {plan.refusal}")


def main(argv: list[str] | None = None) -> int:
    """`python -m glmrt.engine.fit`: the fit of one engine entry as a JSON line (what `glmrt up` runs
    in a child interpreter, so that it never imports torch)."""
    p = argparse.ArgumentParser(prog="python -m glmrt.engine.fit")
    p.add_argument("--engine", required=True, help="the EngineConfig fields, as JSON")
    p.add_argument("--gpu-bytes", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    from backends.adapters import resolve_options
    from backends.registry import detect_hardware
    from glmrt.checkpoint.presets import preset_config
    from glmrt.config import load_model_config
    from glmrt.engine.config import EngineConfig

    torch.set_num_threads(1)
    cfg = EngineConfig(**json.loads(args.engine))
    mc = load_model_config(cfg.model) if cfg.model else preset_config(cfg.preset or "tiny")
    dtype = cfg.resolved_dtype("cuda")
    options = resolve_options(detect_hardware(), cfg.backend_request(), model_dtype=dtype)
    plan = engine_fit(mc, cfg, gpu_bytes=args.gpu_bytes, kv_dtype=options.kv_cache_dtype, model_dtype=dtype,
                      tp_size=args.tp_size, ep_size=args.ep_size)
    print(json.dumps(plan.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
