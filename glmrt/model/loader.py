"""Build the model and fill it: from a safetensors checkpoint (strict) or with random weights.

The model is built on the `meta` device, switched to FP8 where the checkpoint (or
`--quantization fp8`) asks for it, materialised empty on the target device, and then filled
one checkpoint tensor at a time, so a checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from glmrt.config import ModelConfig, QuantConfig, load_model_config
from glmrt.model.glm5_next import Glm5NextForCausalLM
from glmrt.model.layers import Linear, StackedLinear
from glmrt.model.weights import SKIP, Target, quantize_block_fp8, random_tensor, to_internal

# Linear layers that stay in the model dtype under `--quantization fp8` (and that real FP8
# checkpoints list in their ignore list): embeddings/head, router, indexer weights.
_FP8_KEEP = ("lm_head", "mlp.gate", "indexer.weights_proj", "mtp.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the missing/unexpected tensors."""


@dataclass
class LoadReport:
    num_tensors: int
    num_bytes: int
    skipped: list[str]


def _fp8_capable(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (Linear, StackedLinear))
            and not n.startswith("visual")}


def build_model(config: ModelConfig, ops, dtype: torch.dtype, device: torch.device | str, *,
                fp8_modules: Iterable[str] = (), fp8_block: tuple[int, int] = (128, 128),
                with_vision: bool = True, with_mtp: bool = True) -> Glm5NextForCausalLM:
    """An uninitialised model on `device` (contents are garbage until loaded or randomised)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, ops, dtype, with_vision=with_vision, with_mtp=with_mtp)
    capable = _fp8_capable(model)
    for name in fp8_modules:
        if name not in capable:
            raise CheckpointError(f"FP8 scales given for {name!r}, which is not a linear layer of this model")
        capable[name].to_fp8(fp8_block)
    return model.to_empty(device=device).eval()


def default_fp8_modules(model_config: ModelConfig, dtype: torch.dtype) -> list[str]:
    """The linear layers `--quantization fp8` converts (everything but the keep list)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(model_config, None, dtype)
    # Match whole dotted components: "mlp.gate" (the router) must not catch "mlp.gate_proj".
    return [n for n in _fp8_capable(model) if not any(f".{k.strip('.')}." in f".{n}." for k in _FP8_KEEP)]


def unquantized_linear_modules(model_config: ModelConfig, dtype: torch.dtype) -> list[str]:
    """The linear layers `--quantization fp8` keeps in the model dtype (the checkpoint's ignore list)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(model_config, None, dtype)
    fp8 = set(default_fp8_modules(model_config, dtype))
    return [n for n in _fp8_capable(model) if n not in fp8]


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors files in {path}")
    return [os.path.join(path, x) for x in found]


def _summarise(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


def load_checkpoint(path: str | os.PathLike, ops, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", with_vision: bool = True, with_mtp: bool = True,
                    progress: bool | None = None) -> tuple[Glm5NextForCausalLM, LoadReport]:
    """Load a HF-format GLM-5.3-Flash checkpoint directory, strictly.

    Every parameter must be filled by the checkpoint and every checkpoint tensor must land
    somewhere (the MTP layer and vision tower may be skipped on request); otherwise
    CheckpointError lists the names.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    config = load_model_config(path)
    text = config.text
    files = _checkpoint_files(path)
    plan: list[tuple[str, str, Target]] = []
    unexpected, skipped = [], []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tgt = to_internal(key, text, with_mtp=with_mtp, with_vision=with_vision)
                if tgt is None:
                    unexpected.append(key)
                elif tgt is SKIP:
                    skipped.append(key)
                else:
                    plan.append((file, key, tgt))
    fp8 = sorted({t.param[: -len(".weight_scale_inv")] for _, _, t in plan if t.param.endswith(".weight_scale_inv")})
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    model = build_model(config, ops, dtype, device, fp8_modules=fp8, fp8_block=block,
                        with_vision=with_vision, with_mtp=with_mtp)
    params = dict(model.named_parameters())
    unexpected += [key for _, key, t in plan if t.param not in params]
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) not in this model: "
                              f"{_summarise(unexpected)}")
    filled: dict[str, set] = {n: set() for n in params}
    total_bytes = sum(os.path.getsize(f) for f in files)
    bar = None
    if progress or (progress is None and total_bytes > 2 << 30):
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for _, key, tgt in (p for p in plan if p[0] == file):
                t = f.get_tensor(key)
                dst = params[tgt.param].data
                if tgt.expert is not None:
                    dst = dst[tgt.expert]
                if tuple(t.shape) != tuple(dst.shape):
                    raise CheckpointError(f"{key}: shape {tuple(t.shape)} in checkpoint, {tuple(dst.shape)} expected")
                if t.is_floating_point() and t.element_size() == 1 and dst.element_size() != 1:
                    raise CheckpointError(f"{key}: {t.dtype} weight without its weight_scale_inv tensor")
                dst.copy_(t.to(device=dst.device))
                filled[tgt.param].add(tgt.expert)
                if bar:
                    bar.update(t.numel() * t.element_size())
    if bar:
        bar.close()
    missing = []
    for name, got in filled.items():
        p = params[name]
        stacked = name.split(".")[-3] == "experts" if name.count(".") >= 3 else False
        if stacked:
            want = set(range(p.shape[0]))
            missing += [f"{name} (experts {sorted(want - got)[:8]}...)"] if want - got else []
        elif not got:
            missing.append(name)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: {_summarise(missing)}")
    return model, LoadReport(len(plan), total_bytes, skipped)


def init_random(model: Glm5NextForCausalLM, seed: int = 0) -> Glm5NextForCausalLM:
    """Fill every parameter with `random_tensor` values, in place, on the model's device.

    FP8 layers get random values quantised per block (their scales included).
    """
    text = model.config.text
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if name.endswith(".weight_scale_inv"):
            continue
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else None
        if isinstance(owner, (Linear, StackedLinear)) and owner.is_fp8:
            value = random_tensor(name, tuple(p.shape), text, seed, device=p.device)
            q, s = quantize_block_fp8(value, owner.block)
            p.data.copy_(q)
            owner.weight_scale_inv.data.copy_(s)
        else:
            p.data.copy_(random_tensor(name, tuple(p.shape), text, seed, device=p.device))
    return model


def load_dummy(config: ModelConfig, ops, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
               quantization: str | None = None, seed: int = 0, with_vision: bool = True,
               with_mtp: bool = True) -> Glm5NextForCausalLM:
    """`--load-format dummy`: random weights built directly in device memory, no files."""
    fp8: list[str] = []
    block = (128, 128)
    if quantization == "fp8":
        fp8 = default_fp8_modules(config, dtype)
        block = config.quantization.weight_block_size if config.quantization else block
        if config.quantization is None:
            config = ModelConfig(**{**config.__dict__, "quantization": QuantConfig()})
    elif quantization is not None:
        raise ValueError(f"--quantization {quantization!r} is not supported (choose fp8)")
    model = build_model(config, ops, dtype, device, fp8_modules=fp8, fp8_block=block,
                        with_vision=with_vision, with_mtp=with_mtp)
    return init_random(model, seed)


def load_vision_tower(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | str = "cpu"):
    """Only the vision tower of a checkpoint (for a separate vision actor), strictly."""
    from safetensors import safe_open

    from glmrt.model.vision import VisionTower

    path = os.fspath(path)
    config = load_model_config(path)
    if config.vision is None:
        raise CheckpointError(f"{path}: the config has no vision_config")
    with torch.device("meta"):
        tower = VisionTower(config.vision).to(dtype)
    tower = tower.to_empty(device=device).eval()
    params = dict(tower.named_parameters())
    filled = set()
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tgt = to_internal(key, config.text, with_mtp=False, with_vision=True)
                if not isinstance(tgt, Target) or not tgt.param.startswith("visual."):
                    continue
                name = tgt.param[len("visual."):]
                if name not in params:
                    raise CheckpointError(f"{path}: unexpected vision tensor {key}")
                t = f.get_tensor(key)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise CheckpointError(f"{key}: shape {tuple(t.shape)} in checkpoint, "
                                          f"{tuple(params[name].shape)} expected")
                params[name].data.copy_(t)
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} vision tensor(s) missing: {_summarise(missing)}")
    return tower
