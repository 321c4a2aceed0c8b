"""Re-write a checkpoint's own weights in another format (`glmrt make-checkpoint --from DIR`).

glmrt never re-quantises on load (the weight format is the checkpoint's), so a bf16 checkpoint
is served with fp8 weights by converting it once: every tensor the writer would quantise for
`dtype` is quantised from DIR's values (block-scaled e4m3 for fp8, as DeepSeek-V3 releases are),
the rest are written as they are. The tokenizer, chat template and generation config are DIR's.
"""

from __future__ import annotations

import json
import os

import torch

from glmrt.checkpoint.writer import TensorSpec, write_checkpoint
from glmrt.config import ModelConfig
from glmrt.model.weights import nested_name


def read_unquantised(src: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """DIR's config and tensors by name; refused (ValueError) when DIR is already quantised."""
    from safetensors.torch import load_file

    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("quantization_config"):
        raise ValueError(f"{src} is already quantised ({raw['quantization_config'].get('quant_method', '?')}); "
                         "convert from an unquantised (bf16 or float32) checkpoint")
    files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {src}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(src, name)))
    return ModelConfig.from_dict(raw), tensors


def convert_checkpoint(src: str, out: str, dtype: str) -> dict:
    from tokenizers import Tokenizer

    config, tensors = read_unquantised(src)

    def value(spec: TensorSpec) -> torch.Tensor:
        for key in (spec.name, nested_name(spec.name)):
            if key in tensors:
                return tensors[key].float()
        raise ValueError(f"{src} has no tensor {spec.name}")

    generation = None
    gen_path = os.path.join(src, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            generation = json.load(f)
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    return write_checkpoint(config, out, dtype=dtype, values=value, tokenizer_object=tok, generation=generation,
                            progress=False)
