"""Weight names and random weights: the one map between checkpoint names and our parameters.

Checkpoints use the original (pre-HF-conversion) names that `save_pretrained` writes
(docs/MODEL.md §9.1), nested (`model.language_model.*`, `model.visual.*`) or flat (`model.*`,
`visual.*`). Our parameters use the flat names, except that routed experts are stacked:
`...mlp.experts.{E}.gate_proj.weight` is row E of our `...mlp.experts.gate_proj.weight`.
The MTP layer sits at checkpoint layer `num_hidden_layers` and is our `mtp.*`.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

from glmrt.config import TextConfig

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
SKIP = object()


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, and the expert row for stacked ones."""

    param: str
    expert: int | None = None


def to_internal(name: str, text: TextConfig, *, with_mtp: bool, with_vision: bool):
    """Checkpoint name -> Target, SKIP (known but not loaded), or None (unexpected)."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("model.visual."):
        name = "visual." + name[len("model.visual."):]
    if name.startswith("visual."):
        return Target(name) if with_vision else SKIP
    if name.endswith(".weight_scale"):  # Quark exports name the dequant multiplier without `_inv`
        name = name + "_inv"
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= text.num_hidden_layers:
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= text.num_hidden_layers + max(text.num_nextn_predict_layers, 0):
            return None
        if not with_mtp or idx != text.num_hidden_layers:
            return SKIP
        if rest in ("shared_head.head.weight", "embed_tokens.weight"):  # the draft shares the target's
            return SKIP
        name = "mtp." + rest
    elif m and ".hc_head" in name:
        return SKIP
    e = _EXPERT.match(name)
    if e:
        return Target(f"{e.group(1)}.{e.group(3)}.{e.group(4)}", int(e.group(2)))
    return Target(name)


def checkpoint_names(param: str, shape: tuple[int, ...], text: TextConfig) -> Iterator[tuple[str, int | None]]:
    """Our parameter -> the checkpoint names it is written as (flat layout, per-expert split)."""
    if param.startswith("mtp."):
        param = f"model.layers.{text.num_hidden_layers}." + param[len("mtp."):]
    m = re.match(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$", param)
    if m:
        for e in range(shape[0]):
            yield f"{m.group(1)}.{e}.{m.group(2)}.{m.group(3)}", e
    else:
        yield param, None


def nested_name(flat: str) -> str:
    """Flat checkpoint name -> the nested layout HF's save_pretrained writes."""
    if flat.startswith("visual."):
        return "model." + flat
    if flat.startswith("model."):
        return "model.language_model." + flat[len("model."):]
    return flat


# ---- random weights ---------------------------------------------------------------------------

def _seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF


def random_tensor(name: str, shape: tuple[int, ...], text: TextConfig, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic random value for one tensor (by our name or a per-expert checkpoint name).

    Scales keep activations O(1) through every block so that the model really computes
    (gates, pools and routing are not saturated), and the LM head is peaky: logits have a
    spread of ~4, so greedy choices sit far above fp32 noise.
    """
    g = torch.Generator(device=device).manual_seed(_seed(name, seed))

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        # in place: the same values as `randn * std + mean` without a second tensor of the shape
        # (an fp32 expert stack of a full-width layer is 9 GiB; on an 80 GB GPU the bf16
        # model of `flash-4l` fits beside one such tensor, not two)
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(std).add_(mean)

    leaf = name.rsplit(".", 2)
    last = leaf[-1]
    d = text.hidden_size
    if re.search(r"(norm\d?|layernorm|enorm|hnorm)\.weight$", name):
        return normal(0.1, 1.0)
    if re.search(r"norm\.bias$", name):
        return normal(0.1)
    if re.search(r"hc_(attn|ffn)_fn$", name):
        return normal(0.5 / math.sqrt(shape[1]))
    if re.search(r"hc_(attn|ffn)_base$", name):
        return normal(0.3)
    if re.search(r"hc_(attn|ffn)_scale$", name):
        return normal(0.1, 1.0)
    if last == "A_log":
        if text.linear_lower_bound is not None:
            return normal(0.5)
        return torch.rand(shape, generator=g, device=device).mul(15).add(1).log()
    if last == "dt_bias":
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = (torch.rand(shape, generator=g, device=device) * (hi - lo) + lo).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as FLA initialises it
    if last == "e_score_correction_bias":
        return normal(0.05)
    if name.endswith("conv1d.weight"):
        return normal(0.5)
    if last == "index_kpool_compress_gate" or name.endswith("mlp.gate.weight"):
        return normal(1.0 / math.sqrt(d))
    if last == "index_kpool_compress_ape":
        return normal(0.5)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(4.0 / math.sqrt(d))
    if last == "bias":
        return normal(0.02)
    fan_in = shape[-1] if len(shape) >= 2 else 1
    if len(shape) > 2 and ".experts." not in name:
        fan_in = math.prod(shape[1:])
    return normal(1.0 / math.sqrt(fan_in))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., out, in] float -> (e4m3 weight, fp32 scale_inv [.., ceil(out/bo), ceil(in/bi)])."""
    bo, bi = block
    out_dim, in_dim = w.shape[-2], w.shape[-1]
    po, pi = -out_dim % bo, -in_dim % bi
    wp = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    lead = wp.shape[:-2]
    blocks = wp.reshape(*lead, (out_dim + po) // bo, bo, (in_dim + pi) // bi, bi)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[..., :, None, :, None]).reshape(wp.shape)[..., :out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float32)
