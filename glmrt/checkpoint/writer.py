"""Write random-weight checkpoints of the real architecture in the real HF format.

Tensors are generated one at a time from their names (deterministic per seed) and streamed
into safetensors shards, so a 62 GB `flash-4l` never needs more memory than one shard.
Names follow what HF's `save_pretrained` writes (nested `model.language_model.*` and
`model.visual.*`, per-expert tensors, split conv kernels), plus the MTP layer at index
`num_hidden_layers` the way real checkpoints carry it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace

import torch

from glmrt.config import ModelConfig, QuantConfig
from glmrt.model.glm5_next import Glm5NextForCausalLM
from glmrt.model.loader import default_fp8_modules, unquantized_linear_modules
from glmrt.model.weights import checkpoint_names, nested_name, quantize_block_fp8, random_tensor

WRITE_DTYPES = ("float32", "bfloat16", "fp8")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # checkpoint name (flat layout)
    param: str                # our parameter it fills
    shape: tuple[int, ...]
    dtype: torch.dtype        # dtype written
    fp8: bool                 # written as e4m3 + `weight_scale_inv`

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        if self.fp8:
            so, si = -(-self.shape[-2] // 128), -(-self.shape[-1] // 128)
            return n + 4 * so * si
        return n * torch.empty((), dtype=self.dtype).element_size()


def checkpoint_config(config: ModelConfig, dtype: str) -> ModelConfig:
    if dtype == "fp8":
        # The ignore list names every linear layer left unquantised, in checkpoint naming
        # (loaders that trust it, as HF and SGLang do, then expect no scales for them).
        keep = []
        for module in unquantized_linear_modules(config, torch.bfloat16):
            if module.startswith("mtp."):  # the whole draft layer stays bf16, as in real checkpoints
                module = "mtp"
            name = next(checkpoint_names(module + ".weight", (1,), config.text))[0]
            name = nested_name(name)[: -len(".weight")].rstrip(".")
            if name not in keep:
                keep.append(name)
        keep += ["model.language_model.embed_tokens", "model.visual"]
        return replace(config, quantization=QuantConfig(ignored=tuple(keep)))
    return replace(config, quantization=None)


def tensor_specs(config: ModelConfig, dtype: str) -> list[TensorSpec]:
    """Every tensor the checkpoint holds, in write order."""
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(WRITE_DTYPES)}, got {dtype!r}")
    model_dtype = _TORCH[dtype]
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, None, model_dtype)
    fp8_modules = set(default_fp8_modules(config, model_dtype)) if dtype == "fp8" else set()
    specs = []
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        is_fp8 = owner in fp8_modules and pname.endswith(".weight")
        # fp32-kept parameters (conv, A_log, dt_bias, router bias, mHC) are written in fp32.
        wdt = torch.float32 if p.dtype == torch.float32 else model_dtype
        if pname.startswith("visual.") and dtype != "float32":
            wdt = torch.bfloat16
        for cname, expert in checkpoint_names(pname, tuple(p.shape), config.text):
            shape = tuple(p.shape[1:]) if expert is not None else tuple(p.shape)
            specs.append(TensorSpec(cname, pname, shape, wdt, is_fp8))
    return specs


def checkpoint_bytes(config: ModelConfig, dtype: str) -> int:
    return sum(s.nbytes for s in tensor_specs(config, dtype))


def generation_config(config: ModelConfig) -> dict:
    return {"do_sample": True, "temperature": 1.0, "top_p": 0.95,
            "eos_token_id": list(config.text.eos_token_id), "pad_token_id": config.text.pad_token_id}


def write_checkpoint(config: ModelConfig, out_dir: str, *, seed: int = 0, dtype: str = "bfloat16",
                     shard_bytes: int = 4 << 30, layout: str = "nested", tokenizer: bool = True,
                     progress: bool = True) -> dict:
    """Write config.json, weights, generation_config.json and the tokenizer. -> summary."""
    from safetensors.torch import save_file

    specs = tensor_specs(config, dtype)
    os.makedirs(out_dir, exist_ok=True)
    text = config.text
    name_of = nested_name if layout == "nested" else (lambda x: x)
    total = sum(s.nbytes for s in specs)
    bar = None
    if progress and total > 256 << 20:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing weights")
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    tmp_names: list[str] = []

    def flush() -> None:
        tmp = os.path.join(out_dir, f".shard-{len(tmp_names):05d}.tmp")
        save_file(shards[-1], tmp, metadata={"format": "pt"})
        tmp_names.append(tmp)
        shards[-1] = {}
        sizes.append(0)

    weight_map_keys: list[list[str]] = [[]]
    for spec in specs:
        value = random_tensor(spec.name, spec.shape, text, seed)
        out: dict[str, torch.Tensor] = {}
        if spec.fp8:
            q, s = quantize_block_fp8(value, (128, 128))
            out[name_of(spec.name)] = q
            out[name_of(spec.name) + "_scale_inv"] = s
        else:
            out[name_of(spec.name)] = value.to(spec.dtype)
        if sizes[-1] and sizes[-1] + spec.nbytes > shard_bytes:
            flush()
            weight_map_keys.append([])
        shards[-1].update(out)
        weight_map_keys[-1].extend(out)
        sizes[-1] += spec.nbytes
        if bar:
            bar.update(spec.nbytes)
    flush()
    if bar:
        bar.close()
    n = len(tmp_names)
    if n == 1:
        os.replace(tmp_names[0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, (tmp, keys) in enumerate(zip(tmp_names, weight_map_keys)):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(out_dir, final))
            weight_map.update({k: final for k in keys})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg = checkpoint_config(config, dtype)
    cfg_dict = cfg.to_dict()
    cfg_dict["torch_dtype"] = "bfloat16" if dtype == "fp8" else dtype
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_dict, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation_config(config), f, indent=2)
    if tokenizer:
        from glmrt.checkpoint.tokenizer import write_tokenizer
        write_tokenizer(out_dir, text.vocab_size)
    return {"path": out_dir, "tensors": len(specs), "bytes": total, "shards": n}


def check_disk(out_dir: str, need: int) -> None:
    parent = out_dir
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) or "."
    free = shutil.disk_usage(parent or ".").free
    if need > free:
        raise OSError(f"the checkpoint needs {need / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB is free "
                      f"at {parent}")
