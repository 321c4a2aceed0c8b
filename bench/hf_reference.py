"""The Hugging Face reference model built from our model's weights, in memory, on the same device.

`build_hf_from_ours(model, device, dtype)` constructs transformers' `Glm5NextForConditionalGeneration`
(5.17.0) on the meta device, materialises it empty on `device` and fills every parameter and
buffer from our parameters, one tensor at a time (peak memory = our model + HF's, no third
copy, no files). The renames are docs/MODEL.md §9.1 applied to our flat names:

    ours (flat checkpoint names)                      HF in-memory names
    model.X                                           model.language_model.X
    visual.X                                          model.visual.X
    layers.N.hc_{attn,ffn}_{fn,base,scale}            layers.N.{attn,ffn}_hc.{fn,base,scale}
    self_attn.{f_a_proj,f_b_proj}.weight              self_attn.forget_gate.{f_a_proj,f_b_proj}.weight
    self_attn.{dt_bias,A_log}                         self_attn.forget_gate.{dt_bias,A_log}
    self_attn.{q,k,v}_conv1d.weight [Q,1,K] each      self_attn.conv1d.weight [3Q,1,K] rows q | k | v
    mlp.experts.{gate,up}_proj.weight [E,I,D] each    mlp.experts.gate_up_proj [E,2I,D] rows gate | up
    mlp.experts.down_proj.weight [E,D,I]              mlp.experts.down_proj [E,D,I]
    mtp.*                                             (HF has no MTP layer: skipped)

HF's dtypes are those of `from_pretrained(dtype=...)`: everything in `dtype` except
`_keep_in_fp32_modules_strict` (conv1d, A_log, dt_bias, e_score_correction_bias) in fp32 when
`dtype` is fp16/bf16; our fp32 mHC parameters are rounded to `dtype` as HF rounds them. The
non-persistent rotary buffers of the vision tower are recomputed the way HF's `_init_weights`
does after a meta-device load. FP8 models are dequantised into HF's dense weights.

Imports only torch, transformers and our packages (this runs on the GPU machines as is).
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from dataclasses import dataclass

import torch
from torch import nn

# ---- names ----------------------------------------------------------------------------------

_HC = re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_CONV = re.compile(r"^(layers\.\d+\.self_attn)\.(q|k|v)_conv1d\.weight$")
_FGATE = re.compile(r"^(layers\.\d+\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Slot:
    """Where one of our tensors goes in HF: a tensor name, a slice of it, and the part it fills."""

    name: str
    dim: int | None = None       # slice along this dim (None: the whole tensor)
    part: int = 0                # which of `parts` equal slices along `dim`
    parts: int = 1
    tag: str = "all"


def hf_slot(ours: str) -> Slot | None:
    """Our parameter name -> its Slot in HF (None: HF has no such tensor, e.g. MTP)."""
    if ours.startswith("mtp."):
        return None
    if ours.startswith("visual."):
        return Slot("model." + ours)
    if not ours.startswith("model."):
        return Slot(ours)  # lm_head.weight
    rest = ours[len("model."):]
    pre = "model.language_model."
    if m := _HC.match(rest):
        return Slot(f"{pre}{m[1]}.{m[2]}_hc.{m[3]}")
    if m := _CONV.match(rest):
        i = "qkv".index(m[2])
        return Slot(f"{pre}{m[1]}.conv1d.weight", dim=0, part=i, parts=3, tag=m[2])
    if m := _FGATE.match(rest):
        return Slot(f"{pre}{m[1]}.forget_gate.{m[2]}")
    if m := _EXPERTS.match(rest):
        if m[2] == "down_proj":
            return Slot(f"{pre}{m[1]}.down_proj")
        return Slot(f"{pre}{m[1]}.gate_up_proj", dim=1, part=int(m[2] == "up_proj"), parts=2, tag=m[2][:-5])
    return Slot(pre + rest)


def _expected_tags(hf_name: str) -> set[str]:
    if hf_name.endswith(".conv1d.weight"):
        return {"q", "k", "v"}
    if hf_name.endswith(".experts.gate_up_proj"):
        return {"gate", "up"}
    return {"all"}


# ---- config and construction ----------------------------------------------------------------

def import_hf_torch_kda() -> None:
    """Import modeling_glm5_next with its torch KDA on a machine without a GPU.

    transformers binds fla's Triton KDA kernels at import when fla-core is installed (the
    `cuda` extra); they cannot run on the CPU, so there the import sees no fla.
    """
    mod = "transformers.models.glm5_next.modeling_glm5_next"
    if torch.cuda.is_available() or mod in sys.modules:
        return
    saved = sys.modules.get("fla", _MISSING)
    sys.modules["fla"] = None  # `import fla` raises ImportError: the torch path is chosen
    try:
        importlib.import_module(mod)
    finally:
        if saved is _MISSING:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved


_MISSING = object()


def hf_config(model_config, *, attn: str = "eager", experts: str = "eager"):
    """transformers.Glm5NextConfig from our ModelConfig (dense weights: no quantization_config)."""
    import transformers

    import_hf_torch_kda()

    d = model_config.to_dict()
    d.pop("quantization_config", None)
    cfg = transformers.Glm5NextConfig(**d)
    cfg._attn_implementation = attn
    # The per-expert loop of modeling_glm5_next is the readable reference; "grouped_mm" is
    # transformers' default when torch has it (same math, another kernel).
    cfg._experts_implementation = experts
    return cfg


def _keep_fp32(hf_model, dtype: torch.dtype) -> tuple[str, ...]:
    if dtype not in (torch.float16, torch.bfloat16):
        return ()
    return tuple(sorted(getattr(hf_model, "_keep_in_fp32_modules_strict", None) or ()))


def _cast_meta(hf_model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Give every meta tensor the dtype `from_pretrained(dtype=dtype)` would give it.

    Parameters and persistent buffers take `dtype` unless their name matches the model's
    `_keep_in_fp32_modules_strict` (then fp32); non-persistent buffers (rotary inv_freq)
    stay as constructed (fp32). Tied parameters stay tied. Returns name -> dtype.
    """
    keep = _keep_fp32(hf_model, dtype)
    new: dict[int, nn.Parameter] = {}
    out: dict[str, torch.dtype] = {}
    for mod_name, mod in hf_model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = prefix + key
            want = torch.float32 if any(k in full for k in keep) else dtype
            if id(p) not in new:
                q = p if p.dtype == want or not p.is_floating_point() else \
                    nn.Parameter(torch.empty_like(p, dtype=want), requires_grad=False)
                q.requires_grad_(False)
                new[id(p)] = q
            mod._parameters[key] = new[id(p)]
            out[full] = new[id(p)].dtype
        for key, b in list(mod._buffers.items()):
            if b is None:
                continue
            full = prefix + key
            if key not in mod._non_persistent_buffers_set and b.is_floating_point():
                want = torch.float32 if any(k in full for k in keep) else dtype
                if b.dtype != want:
                    mod._buffers[key] = torch.empty_like(b, dtype=want)
            out[full] = mod._buffers[key].dtype
    return out


def _tie_groups(hf_model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    seen: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in hf_model.modules():
        for key, p in mod._parameters.items():
            if p is not None:
                seen.setdefault(id(p), []).append((mod, key))
    return [g for g in seen.values() if len(g) > 1]


def _init_rotary_buffers(hf_model: nn.Module, filled: dict[str, set[str]]) -> None:
    """Recompute non-persistent rotary buffers exactly as PreTrainedModel._init_weights does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for mod_name, mod in hf_model.named_modules():
        if "RotaryEmbedding" not in type(mod).__name__ or not hasattr(mod, "original_inv_freq"):
            continue
        fns = {"axial": getattr(mod, "compute_axial_rope_parameters", None),
               "default": getattr(mod, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
        value, _ = fns[mod.rope_type](mod.config)
        for key in ("inv_freq", "original_inv_freq"):
            getattr(mod, key).copy_(value)
            filled[f"{mod_name}.{key}"] = {"all"}


def _dest(hf_tensors: dict[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    t = hf_tensors[slot.name]
    if slot.dim is None:
        return t
    size = t.shape[slot.dim] // slot.parts
    return t.narrow(slot.dim, slot.part * size, size)


def _fp8_owner(modules: dict[str, nn.Module], ours: str):
    owner = modules.get(ours.rsplit(".", 1)[0]) if "." in ours else None
    if owner is not None and ours.endswith(".weight") and getattr(owner, "weight_scale_inv", None) is not None:
        return owner
    return None


@torch.no_grad()
def build_hf_from_ours(model, device: torch.device | str, dtype: torch.dtype, *,
                       attn: str = "eager", experts: str = "eager"):
    """transformers' Glm5NextForConditionalGeneration holding a copy of `model`'s weights.

    Built on the meta device, materialised with `to_empty` on `device`, then filled tensor by
    tensor straight from our parameters (only FP8 weights pass through a per-matrix
    dequantised temporary). Raises RuntimeError if any HF parameter or buffer was not filled,
    if one of ours found no place in HF, or on a shape mismatch.
    """
    from transformers import Glm5NextForConditionalGeneration

    from backends.fp8_numerics import dequantize_block_fp8

    cfg = hf_config(model.config, attn=attn, experts=experts)
    with torch.device("meta"):
        hf = Glm5NextForConditionalGeneration(cfg)
    _cast_meta(hf, dtype)
    ties = _tie_groups(hf)
    hf = hf.to_empty(device=device)
    for group in ties:  # to_empty gives every module its own tensor: tie them again
        mod0, key0 = group[0]
        for mod, key in group[1:]:
            mod._parameters[key] = mod0._parameters[key0]
    hf.eval().requires_grad_(False)

    hf_tensors: dict[str, torch.Tensor] = {n: p.data for n, p in hf.named_parameters()}
    hf_tensors.update(dict(hf.named_buffers()))
    filled: dict[str, set[str]] = {}
    modules = dict(model.named_modules())
    text = model.config.text
    unplaced: list[str] = []
    for name, p in model.named_parameters():
        if name.endswith(".weight_scale_inv"):
            continue  # consumed with its weight
        slot = hf_slot(name)
        if slot is None or (name == "lm_head.weight" and text.tie_word_embeddings):
            continue  # MTP; an unused head of a tied model (HF's lm_head is the embedding)
        if slot.name not in hf_tensors:
            unplaced.append(f"{name} -> {slot.name}")
            continue
        dst = _dest(hf_tensors, slot)
        if tuple(dst.shape) != tuple(p.shape):
            raise RuntimeError(f"{name} {tuple(p.shape)} does not fit HF {slot.name}"
                               f"{'' if slot.dim is None else f' part {slot.tag}'} {tuple(dst.shape)}")
        owner = _fp8_owner(modules, name)
        if owner is None:
            dst.copy_(p.data)
        elif p.dim() == 3:  # stacked experts: one expert at a time keeps the temporary small
            for e in range(p.shape[0]):
                dst[e].copy_(dequantize_block_fp8(p.data[e], owner.weight_scale_inv[e], owner.block, dst.dtype))
        else:
            dst.copy_(dequantize_block_fp8(p.data, owner.weight_scale_inv, owner.block, dst.dtype))
        tags = filled.setdefault(slot.name, set())
        if slot.tag in tags:
            raise RuntimeError(f"HF {slot.name} part {slot.tag} filled twice (second time from {name})")
        tags.add(slot.tag)
    _init_rotary_buffers(hf, filled)
    missing = [f"{n} (missing {sorted(_expected_tags(n) - filled.get(n, set()))})"
               for n in hf_tensors if filled.get(n, set()) != _expected_tags(n)]
    if missing or unplaced:
        raise RuntimeError(f"HF model not fully filled from ours: {len(missing)} HF tensor(s) unfilled: "
                           f"{', '.join(missing[:20])}; {len(unplaced)} of ours without a place in HF: "
                           f"{', '.join(unplaced[:20])}")
    return hf


@torch.no_grad()
def round_ours_to_hf_(model, dtype: torch.dtype) -> list[str]:
    """Round, in place, every parameter we keep in fp32 but HF stores in `dtype` (the mHC
    fn/base/scale), so that both models hold exactly the same values (as a checkpoint saved
    in `dtype` would give both). Returns the names rounded.
    """
    from transformers import Glm5NextForConditionalGeneration

    if dtype == torch.float32:
        return []
    keep = tuple(Glm5NextForConditionalGeneration._keep_in_fp32_modules_strict or ())
    done = []
    for name, p in model.named_parameters():
        slot = hf_slot(name)
        if slot is None or p.dtype != torch.float32 or any(k in slot.name for k in keep):
            continue
        p.copy_(p.to(dtype))
        done.append(name)
    return done


# ---- running it -----------------------------------------------------------------------------

@torch.no_grad()
def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence forward, no cache: ids [B, S] -> logits [B, S, V] (model dtype, on HF's device)."""
    dev = hf_model.lm_head.weight.device
    return hf_model(input_ids=ids.to(dev), use_cache=False).logits


@torch.no_grad()
def hf_logits_incremental(hf_model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """The same logits through HF's own cache: feed `chunks` tokens at a time (sum = S).

    HF's chunked prefill / single-token decode path (DynamicCache, KDA recurrent step for
    one token): a second reference and a smaller activation footprint per forward.
    """
    if sum(chunks) != ids.shape[1]:
        raise ValueError(f"chunks {chunks} do not add up to {ids.shape[1]} tokens")
    dev = hf_model.lm_head.weight.device
    cache, outs, start = None, [], 0
    for n in chunks:
        out = hf_model(input_ids=ids[:, start:start + n].to(dev), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        outs.append(out.logits)
        start += n
    return torch.cat(outs, dim=1)


# ---- memory estimate ------------------------------------------------------------------------

_GiB = 1 << 30


def estimate_hf_activation_bytes(text, seq_len: int, dtype: torch.dtype, *, batch: int = 1,
                                 kv_len: int | None = None) -> dict[str, float]:
    """Peak extra bytes of one HF eager forward over `seq_len` new tokens (torch fallbacks).

    `kv_len` is the total length including cached tokens (default: seq_len, no cache).
    Read off modeling_glm5_next.py (each term is the largest set of tensors alive at once):

    * KDA (`chunk_kimi_delta_attention` torch fallback): `decay_mask` [B,H,chunks,64,64,dk]
      fp32 stays alive for the whole call, and `k_beta*key*decay_mask` holds two more of that
      size at once -> 3 x B*H*ceil(S/64)*64*64*dk*4; plus ~13 fp32 copies of q/k/v/g
      (transposed, padded, scaled, l2-normed) and the conv in fp32.
    * DSA eager attention: scores [B,H,S,T]; `softmax(w + mask, dtype=fp32).to(dtype)` keeps
      the input, the fp32 result and the cast copy alive at once -> ~8 bytes per score
      element in bf16 and fp32; plus the [B,S,T] top-k mask (int32 counts, bool, additive),
      the indexer's [B,S,Hi,T/kpool] fp32 scores and the per-head expanded K/V.
    * MoE: the one-hot routing mask [S, k, E] int64 and router fp32 scores; dense MLP [S, I].
    * mHC: the [S, M*D] fp32 flattened streams (x, x^2, normed) and the fp32 collapse.
    * always alive: embeddings and two copies of the [S, M, D] streams; at the end the
      [S, V] logits.
    """
    e = torch.finfo(dtype).bits // 8
    s, t = batch * seq_len, batch * (kv_len or seq_len)
    d, m, v = text.hidden_size, text.hc_mult, text.vocab_size
    base = s * d * e * (1 + 2 * m)
    parts: dict[str, float] = {}
    if text.kda_layers:
        h, dk = text.linear_num_heads, text.linear_head_dim
        q = h * dk
        padded = batch * math.ceil(seq_len / 64) * 64
        decay = h * padded * 64 * dk * 4
        parts["kda"] = 3 * decay + s * q * (3 * e + 13 * 4) + s * 3 * q * (e + 2 * 4)
    if text.dsa_layers:
        h = text.num_attention_heads
        scores = 8 * h * s * (kv_len or seq_len)
        mask = 7 * s * (kv_len or seq_len)
        indexer = 8 * text.index_n_heads * s * math.ceil((kv_len or seq_len) / text.index_kpool)
        kv = t * h * (2 * text.qk_head_dim + text.qk_nope_head_dim + 2 * text.v_head_dim) * e
        parts["dsa"] = scores + mask + indexer + kv + s * h * text.qk_head_dim * e
    if any(text.is_moe(i) for i in range(text.num_hidden_layers)):
        ek = text.n_routed_experts
        parts["moe"] = s * (8 * text.num_experts_per_tok * ek + 20 * ek
                            + 3 * text.moe_intermediate_size * text.n_shared_experts * e + 2 * d * e)
    if not all(text.is_moe(i) for i in range(text.num_hidden_layers)):
        parts["dense_mlp"] = s * (3 * text.intermediate_size + d) * e
    parts["mhc"] = s * m * d * (3 * 4 + 4) + s * d * 4
    parts["lm_head"] = s * v * e + s * d * 4
    peak_part = max(parts, key=parts.get)
    out = {f"{k}_bytes": float(x) for k, x in parts.items()}
    out.update(always_bytes=float(base), peak_part=peak_part, peak_bytes=float(base + parts[peak_part]))
    return out


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
