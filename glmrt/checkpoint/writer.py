"""Write random-weight checkpoints of the real architecture in the real HF format.

Tensors are generated one at a time from their names (deterministic per seed) and streamed
into safetensors shards, so a 62 GB `flash-4l` never needs more memory than one shard.
Names follow what HF's `save_pretrained` writes (nested `model.language_model.*` and
`model.visual.*`, per-expert tensors, split conv kernels), plus the MTP layer at index
`num_hidden_layers` the way real checkpoints carry it.

`--dtype fp8` writes DeepSeek-V3 block-scaled e4m3 (docs/MODEL.md §9.2). `--dtype mxfp4` (Quark
export) and `--dtype nvfp4` (ModelOpt export) pack the MLP linear layers — dense MLPs, shared
experts and every routed expert — the way the real FP4 releases of DeepSeek-class models do,
and leave attention, router, embeddings, lm_head, the MTP layer and vision in bf16 (listed in
the ignore list); layouts and scale choice in glmrt/checkpoint/fp4.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace

import torch

from glmrt.checkpoint import fp4
from glmrt.config import ModelConfig, QuantConfig
from glmrt.model.glm5_next import Glm5NextForCausalLM
from glmrt.model.loader import _fp8_capable, default_fp8_modules, unquantized_linear_modules
from glmrt.model.weights import checkpoint_names, nested_name, quantize_block_fp8, random_tensor

WRITE_DTYPES = ("float32", "bfloat16", "fp8", "mxfp4", "nvfp4")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.bfloat16,
          "mxfp4": torch.bfloat16, "nvfp4": torch.bfloat16}


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # checkpoint name (flat layout)
    param: str                # our parameter it fills
    shape: tuple[int, ...]
    dtype: torch.dtype        # dtype written
    fp8: bool                 # written as e4m3 + `weight_scale_inv`
    fp4: str | None = None    # "mxfp4" / "nvfp4": written packed with its scales (fp4.py)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        if self.fp8:
            so, si = -(-self.shape[-2] // 128), -(-self.shape[-1] // 128)
            return n + 4 * so * si
        if self.fp4 == "mxfp4":
            return n // 2 + n // fp4.MXFP4_GROUP
        if self.fp4 == "nvfp4":
            return n // 2 + n // fp4.NVFP4_GROUP + 8
        return n * torch.empty((), dtype=self.dtype).element_size()


def fp4_modules(config: ModelConfig, scheme: str) -> list[str]:
    """The linear layers `--dtype mxfp4|nvfp4` packs: the MLPs (dense, shared and routed experts)
    of the target model whose input dimension is a multiple of the scale group."""
    group = fp4.GROUP_SIZE[scheme]
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, None, torch.bfloat16)
    capable = _fp8_capable(model)
    keep = set(default_fp8_modules(config, torch.bfloat16))
    return [n for n, m in capable.items() if n in keep and ".mlp." in f".{n}." and not n.startswith("mtp.")
            and m.in_features % group == 0]


def _ignore_list(config: ModelConfig, unquantised: list[str], prefix=lambda name: name) -> list[str]:
    """Unquantised linear layers in checkpoint naming (loaders that trust the list, as HF,
    vLLM and SGLang do, then expect no scales for them); the MTP layer and the vision tower as
    one entry each, written by `prefix` in the format's own pattern syntax."""
    keep = []
    for module in unquantised:
        whole = module.startswith("mtp.")
        if whole:  # the whole draft layer stays bf16, as in real checkpoints
            module = "mtp"
        name = next(checkpoint_names(module + ".weight", (1,), config.text))[0]
        name = nested_name(name)[: -len(".weight")].rstrip(".")
        name = prefix(name) if whole else name
        if name not in keep:
            keep.append(name)
    return keep + ["model.language_model.embed_tokens", prefix("model.visual")]


def checkpoint_config(config: ModelConfig, dtype: str) -> ModelConfig:
    if dtype in fp4.FP4_SCHEMES:
        packed = set(fp4_modules(config, dtype))
        with torch.device("meta"):
            model = Glm5NextForCausalLM(config, None, torch.bfloat16)
        rest = [n for n in _fp8_capable(model) if n not in packed]
        if dtype == "mxfp4":  # Quark matches `exclude` entries exactly, or as `re:` regexes
            ignored = _ignore_list(config, rest, lambda n: "re:" + re.escape(n) + r"\..*")
            return replace(config, quantization=QuantConfig.mxfp4(tuple(ignored)))
        ignored = _ignore_list(config, rest, lambda n: n + "*")  # ModelOpt: fnmatch wildcards
        return replace(config, quantization=QuantConfig.nvfp4(tuple(ignored)))
    if dtype == "fp8":
        ignored = _ignore_list(config, unquantized_linear_modules(config, torch.bfloat16))
        return replace(config, quantization=QuantConfig(ignored=tuple(ignored)))
    return replace(config, quantization=None)


def tensor_specs(config: ModelConfig, dtype: str) -> list[TensorSpec]:
    """Every tensor the checkpoint holds, in write order."""
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(WRITE_DTYPES)}, got {dtype!r}")
    model_dtype = _TORCH[dtype]
    with torch.device("meta"):
        model = Glm5NextForCausalLM(config, None, model_dtype)
    fp8_modules = set(default_fp8_modules(config, model_dtype)) if dtype == "fp8" else set()
    fp4_set = set(fp4_modules(config, dtype)) if dtype in fp4.FP4_SCHEMES else set()
    specs = []
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        is_fp8 = owner in fp8_modules and pname.endswith(".weight")
        packed = dtype if owner in fp4_set and pname.endswith(".weight") else None
        # fp32-kept parameters (conv, A_log, dt_bias, router bias, mHC) are written in fp32.
        wdt = torch.float32 if p.dtype == torch.float32 else model_dtype
        if pname.startswith("visual.") and dtype != "float32":
            wdt = torch.bfloat16
        for cname, expert in checkpoint_names(pname, tuple(p.shape), config.text):
            shape = tuple(p.shape[1:]) if expert is not None else tuple(p.shape)
            specs.append(TensorSpec(cname, pname, shape, wdt, is_fp8, packed))
    return specs


# gate_proj and up_proj of one MLP / expert are fused by FP4 engines and share weight_scale_2.
_NVFP4_PARTNER = {".gate_proj.weight": ".up_proj.weight", ".up_proj.weight": ".gate_proj.weight"}

# Placeholder static activation scale written for NVFP4 (W4A4 engines need one per layer; random
# weights have no calibration data): activations up to |x| = 8, i.e. 8 / (6 * 448).
NVFP4_INPUT_SCALE = 8.0 / (fp4.E2M1_MAX * fp4.E4M3_MAX)


def quantize_fp4_tensor(spec: TensorSpec, value: torch.Tensor, text, seed: int) -> dict[str, torch.Tensor]:
    """One packed weight and its companions, by flat checkpoint name."""
    if spec.fp4 == "mxfp4":
        q, s = fp4.quantize_mxfp4(value)
        return {spec.name: q, spec.name + "_scale": s}
    amax = value.abs().amax()
    for suffix, other in _NVFP4_PARTNER.items():
        if spec.name.endswith(suffix):
            partner = spec.name[: -len(suffix)] + other
            amax = torch.maximum(amax, random_tensor(partner, spec.shape, text, seed).abs().amax())
    q, s, g = fp4.quantize_nvfp4(value, fp4.nvfp4_global_scale(amax))
    base = spec.name[: -len(".weight")]
    return {spec.name: q, spec.name + "_scale": s, spec.name + "_scale_2": g,
            base + ".input_scale": torch.tensor(NVFP4_INPUT_SCALE, dtype=torch.float32)}


def checkpoint_bytes(config: ModelConfig, dtype: str) -> int:
    return sum(s.nbytes for s in tensor_specs(config, dtype))


def generation_config(config: ModelConfig) -> dict:
    return {"do_sample": True, "temperature": 1.0, "top_p": 0.95,
            "eos_token_id": list(config.text.eos_token_id), "pad_token_id": config.text.pad_token_id}


def write_checkpoint(config: ModelConfig, out_dir: str, *, seed: int = 0, dtype: str = "bfloat16",
                     shard_bytes: int = 4 << 30, layout: str = "nested", tokenizer: bool = True,
                     progress: bool = True, values=None, tokenizer_object=None,
                     generation: dict | None = None) -> dict:
    """Write config.json, weights, generation_config.json and the tokenizer. -> summary.

    `values(spec) -> tensor`: the weights to write (a trained model's; default: random ones of
    `seed`); `tokenizer_object`: the tokenizer to ship (default: the built-in one);
    `generation`: generation_config.json's contents (default: `generation_config(config)`)."""
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
        value = random_tensor(spec.name, spec.shape, text, seed) if values is None else values(spec)
        out: dict[str, torch.Tensor] = {}
        if spec.fp8:
            q, s = quantize_block_fp8(value, (128, 128))
            out[name_of(spec.name)] = q
            out[name_of(spec.name) + "_scale_inv"] = s
        elif spec.fp4:
            out.update({name_of(k): v for k, v in quantize_fp4_tensor(spec, value, text, seed).items()})
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
    cfg_dict["torch_dtype"] = str(_TORCH[dtype]).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_dict, f, indent=2)
    hf_quant = cfg.quantization.hf_quant_config() if cfg.quantization else None
    if hf_quant is not None:  # ModelOpt releases carry both files
        with open(os.path.join(out_dir, "hf_quant_config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_quant, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation or generation_config(config), f, indent=2)
    if tokenizer:
        from glmrt.checkpoint.tokenizer import write_tokenizer
        write_tokenizer(out_dir, text.vocab_size, tokenizer_object)
    return {"path": out_dir, "tensors": len(specs), "bytes": total, "shards": n}


def check_disk(out_dir: str, need: int) -> None:
    parent = out_dir
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) or "."
    free = shutil.disk_usage(parent or ".").free
    if need > free:
        raise OSError(f"the checkpoint needs {need / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB is free "
                      f"at {parent}")
