"""Model configuration: parse any GLM-5.3-Flash family `config.json` into frozen dataclasses.

Accepts the nested form HF writes (`text_config` / `vision_config`) and the flat, text-only
form (text fields at the top level, as SGLang configs and some real checkpoints do). Applies
the same derivations as HF's `Glm5NextTextConfig.__post_init__` (layer schedules,
`index_topk_pattern` / freq+offset, `linear_attn_config`) and validates with errors that name
the offending field. No torch here: this module is imported by data-only code too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

KDA = "linear_attention"
DSA = "deepseek_sparse_attention"
_LAYER_TYPE_ALIASES = {"full_attention": DSA, "sparse_attention": DSA, "kda": KDA}


class ConfigError(ValueError):
    """A config.json that glmrt cannot serve; the message names the field."""


# FP4 weight formats: elements per scale along the input dim (layouts: glmrt/checkpoint/fp4.py).
FP4_GROUP_SIZE = {"mxfp4": 32, "nvfp4": 16}

# The MXFP4 weight spec of a Quark export (what AMD's MI355X releases carry).
_QUARK_MXFP4 = {"dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32, "is_dynamic": False,
                "symmetric": None, "round_method": "half_even", "scale_type": "float", "scale_format": "e8m0",
                "scale_calculation_mode": "even", "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver",
                "is_scale_quant": False}


def _is_quark_mxfp4(spec: Any) -> bool:
    if not isinstance(spec, dict):
        return False
    if spec.get("dtype") == "mx" and spec.get("mx_element_dtype") == "fp4":  # older Quark exports
        return int(spec.get("group_size") or 32) == 32
    return (spec.get("dtype") == "fp4" and spec.get("qscheme") == "per_group"
            and spec.get("group_size") is not None and int(spec["group_size"]) == 32
            and (spec.get("scale_format") == "e8m0"
                 or (spec.get("scale_format") is None and "MX" in str(spec.get("observer_cls") or ""))))


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of a checkpoint, one of three weight formats (`scheme`):

    * "fp8": block-scaled e4m3, DeepSeek-V3 convention (`quant_method: "fp8"`, MODEL.md §9.2);
    * "mxfp4": OCP MXFP4 as AMD Quark exports it (`quant_method: "quark"`, MXFP4 weight spec;
      HF's `quant_method: "mxfp4"` spelling is read as the same format);
    * "nvfp4": NVIDIA ModelOpt NVFP4 (`quant_method: "modelopt"`, `quant_algo: "NVFP4"`, flat
      config.json form or the nested `hf_quant_config.json` form).

    `ignored` is the checkpoint's list of linear layers left in the model dtype. Tensor layouts
    of the FP4 formats: glmrt/checkpoint/fp4.py.
    """

    quant_method: str = "fp8"
    fmt: str = "e4m3"  # weight format: "e4m3" (fp8), "mxfp4", "nvfp4"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"  # FP4: "dynamic" / "static" (W4A4 engines) or "none" (W4A16)
    ignored: tuple[str, ...] = ()
    scale_fmt: str | None = None
    group_size: int | None = None  # FP4: elements per scale along the input dim

    @property
    def scheme(self) -> str:
        """"fp8", "mxfp4" or "nvfp4"."""
        return "fp8" if self.quant_method == "fp8" else self.fmt

    @property
    def is_fp4(self) -> bool:
        return self.scheme in FP4_GROUP_SIZE

    @classmethod
    def mxfp4(cls, ignored: tuple[str, ...] = (), *, quant_method: str = "quark",
              activation_scheme: str = "dynamic") -> "QuantConfig":
        return cls(quant_method, "mxfp4", activation_scheme=activation_scheme, ignored=tuple(ignored),
                   group_size=FP4_GROUP_SIZE["mxfp4"])

    @classmethod
    def nvfp4(cls, ignored: tuple[str, ...] = (), *, activation_scheme: str = "static") -> "QuantConfig":
        return cls("modelopt", "nvfp4", activation_scheme=activation_scheme, ignored=tuple(ignored),
                   group_size=FP4_GROUP_SIZE["nvfp4"])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantConfig":
        method = str(d.get("quant_method", "fp8")).lower()
        if method == "quark":
            return cls._from_quark(d)
        if method == "mxfp4":  # HF's Mxfp4Config spelling
            return cls.mxfp4(tuple(d.get("modules_to_not_convert") or ()), quant_method="mxfp4")
        if method == "modelopt" or method == "modelopt_fp4":
            return cls._from_modelopt(d)
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method={method!r} is not supported "
                              "(fp8; quark or mxfp4 for MXFP4; modelopt for NVFP4)")
        block = d.get("weight_block_size") or [128, 128]
        if len(block) != 2:
            raise ConfigError(f"quantization_config.weight_block_size must have 2 entries, got {block!r}")
        ignored = d.get("ignore") or d.get("ignored_layers") or d.get("modules_to_not_convert") or []
        return cls(method, d.get("fmt", "e4m3"), (int(block[0]), int(block[1])),
                   d.get("activation_scheme", "dynamic"), tuple(ignored), d.get("scale_fmt"))

    @classmethod
    def _from_quark(cls, d: dict[str, Any]) -> "QuantConfig":
        g = d.get("global_quant_config") or {}
        weight = g.get("weight")
        if not _is_quark_mxfp4(weight):
            raise ConfigError("quantization_config: only the MXFP4 Quark scheme is supported (weight dtype fp4, "
                              f"per_group, group_size 32, e8m0 scales); global_quant_config.weight is {weight!r}")
        for key in ("layer_quant_config", "layer_type_quant_config"):
            for name, spec in (d.get(key) or {}).items():
                w = (spec or {}).get("weight")
                if w is not None and not _is_quark_mxfp4(w):
                    raise ConfigError(f"quantization_config.{key}[{name!r}]: only MXFP4 weights are supported, "
                                      f"got {w!r}")
        act = "dynamic" if isinstance(g.get("input_tensors"), dict) else "none"
        return cls.mxfp4(tuple(d.get("exclude") or ()), activation_scheme=act)

    @classmethod
    def _from_modelopt(cls, d: dict[str, Any]) -> "QuantConfig":
        q = d["quantization"] if isinstance(d.get("quantization"), dict) else d  # hf_quant_config.json form
        algo = str(q.get("quant_algo") or "").upper()
        if algo not in ("NVFP4", "W4A16_NVFP4"):
            raise ConfigError(f"quantization_config: ModelOpt quant_algo={algo or None!r} is not supported "
                              "(only NVFP4)")
        group = int(q.get("group_size") or 16)
        if group != 16:
            raise ConfigError(f"quantization_config.group_size must be 16 for NVFP4, got {group}")
        ignored = q.get("ignore") or q.get("exclude_modules") or d.get("ignore") or []
        return cls.nvfp4(tuple(ignored), activation_scheme="static" if algo == "NVFP4" else "none")

    def to_dict(self) -> dict[str, Any]:
        if self.scheme == "mxfp4":
            if self.quant_method == "mxfp4":
                return {"quant_method": "mxfp4", "modules_to_not_convert": list(self.ignored)}
            act = {**_QUARK_MXFP4, "is_dynamic": True} if self.activation_scheme != "none" else None
            return {"quant_method": "quark", "quant_mode": "eager_mode", "version": "0.10",
                    "global_quant_config": {"weight": dict(_QUARK_MXFP4), "input_tensors": act,
                                            "output_tensors": None, "bias": None, "target_device": None},
                    "layer_quant_config": {}, "layer_type_quant_config": {}, "exclude": list(self.ignored),
                    "algo_config": None,
                    "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                               "weight_format": "real_quantized", "weight_merge_groups": None}}
        if self.scheme == "nvfp4":
            algo = "NVFP4" if self.activation_scheme != "none" else "W4A16_NVFP4"
            fp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
            group = {"weights": fp4, "targets": ["Linear"]}
            if algo == "NVFP4":
                group["input_activations"] = dict(fp4)
            return {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "kv_cache_quant_algo": None,
                    "producer": {"name": "modelopt"}, "config_groups": {"group_0": group},
                    "ignore": list(self.ignored)}
        d = {"quant_method": self.quant_method, "fmt": self.fmt,
             "activation_scheme": self.activation_scheme,
             "weight_block_size": list(self.weight_block_size), "ignore": list(self.ignored)}
        if self.scale_fmt:
            d["scale_fmt"] = self.scale_fmt
        return d

    def hf_quant_config(self) -> dict[str, Any] | None:
        """The legacy ModelOpt `hf_quant_config.json` (NVFP4 only; older loaders read only this file)."""
        if self.scheme != "nvfp4":
            return None
        d = self.to_dict()
        return {"producer": d["producer"],
                "quantization": {"quant_algo": d["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": list(self.ignored)}}


@dataclass(frozen=True)
class TextConfig:
    """The language model (`text_config`). Defaults are the full-size GLM-5.3-Flash."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float | None = 10.0
    hidden_act: str = "silu"
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    eos_token_id: tuple[int, ...] = ()
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 0

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def is_dsa(self, layer: int) -> bool:
        return self.layer_types[layer] == DSA

    def has_indexer(self, layer: int) -> bool:
        return self.is_dsa(layer) and self.indexer_types[layer] == "full"

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @property
    def dsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_dsa(i))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_dsa(i))

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.dsa_layers if self.has_indexer(i))

    @property
    def index_topk_pools(self) -> int:
        return self.index_topk // self.index_kpool

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TextConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        nullable = ("pad_token_id", "swiglu_limit", "linear_lower_bound")
        kw: dict[str, Any] = {k: d[k] for k in known if k in d and (d[k] is not None or k in nullable)}
        if "num_local_experts" in d and "n_routed_experts" not in d:
            kw["n_routed_experts"] = d["num_local_experts"]
        la = d.get("linear_attn_config")
        if la is not None:
            if not isinstance(la, dict):
                raise ConfigError("linear_attn_config must be an object")
            kw["linear_head_dim"] = la.get("head_dim", kw.get("linear_head_dim", cls.linear_head_dim))
            kw["linear_num_heads"] = la.get("num_heads", kw.get("linear_num_heads", cls.linear_num_heads))
            kw["linear_conv_kernel_dim"] = la.get("short_conv_kernel_size",
                                                  kw.get("linear_conv_kernel_dim", cls.linear_conv_kernel_dim))
            lb = la.get("gate_lower_bound", kw.get("linear_lower_bound", cls.linear_lower_bound))
            if la.get("safe_gate", True) and lb is None:
                lb = -5.0
            kw["linear_lower_bound"] = lb
        n = int(kw.get("num_hidden_layers", cls.num_hidden_layers))
        kw["num_hidden_layers"] = n
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", cls.num_attention_heads)
        # Layer schedules, derived exactly as HF does when absent.
        lt = d.get("layer_types")
        if lt is None and isinstance(la, dict) and la.get("full_attn_layers") is not None:
            full = {int(i) - 1 if la.get("one_indexed") else int(i) for i in la["full_attn_layers"]}
            lt = [DSA if i in full else KDA for i in range(n)]
        if lt is None:
            lt = [KDA if i % 4 != 3 else DSA for i in range(n)]
        kw["layer_types"] = tuple(_LAYER_TYPE_ALIASES.get(t, t) for t in lt)
        mt = d.get("mlp_layer_types")
        if mt is None:
            k_dense = int(d.get("first_k_dense_replace", 3))
            mt = ["dense"] * min(k_dense, n) + ["sparse"] * max(n - k_dense, 0)
        kw["mlp_layer_types"] = tuple(mt)
        it = d.get("indexer_types")
        if it is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                try:
                    it = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) \
                        else list(pattern)
                except KeyError as e:
                    raise ConfigError(f"index_topk_pattern must use only 'F'/'S', got {pattern!r}") from e
            else:
                freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
                off = int(d.get("index_skip_topk_offset", 2))
                it = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
        kw["indexer_types"] = tuple(it)
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        kw["num_nextn_predict_layers"] = int(d.get("num_nextn_predict_layers") or 0)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        n = self.num_hidden_layers
        if n < 1:
            raise ConfigError(f"num_hidden_layers must be >= 1, got {n}")
        for name in ("layer_types", "indexer_types", "mlp_layer_types"):
            v = getattr(self, name)
            if len(v) != n:
                raise ConfigError(f"{name} has {len(v)} entries but num_hidden_layers is {n}")
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, DSA):
                raise ConfigError(f"layer_types[{i}]={t!r}: expected 'linear_attention' or "
                                  f"'deepseek_sparse_attention' (alias 'full_attention')")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in ("dense", "sparse"):
                raise ConfigError(f"mlp_layer_types[{i}]={t!r}: expected 'dense' or 'sparse'")
        for i, t in enumerate(self.indexer_types):
            if t not in ("full", "shared"):
                raise ConfigError(f"indexer_types[{i}]={t!r}: expected 'full' or 'shared'")
        # A shared layer reuses the selection of the DSA layer right before it (a full layer, or
        # a shared one that carries a full layer's selection on): a KDA layer in between, or a
        # shared first DSA layer, has nothing to reuse.
        for i in self.dsa_layers:
            if self.indexer_types[i] == "shared" and (i == 0 or not self.is_dsa(i - 1)):
                raise ConfigError(
                    f"indexer_types[{i}]='shared' but layer {i - 1} is not a DSA layer: a shared indexer "
                    "layer must directly follow a DSA layer whose selection it reuses")
        if self.num_attention_heads != self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads ({self.num_key_value_heads}) must equal "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.q_lora_rank is None or self.q_lora_rank <= 0:
            raise ConfigError("q_lora_rank is required (DSA layers use the q LoRA path)")
        if self.qk_rope_head_dim != 0:
            raise ConfigError(f"qk_rope_head_dim must be 0 (GLM-5.3-Flash is NoPE), got {self.qk_rope_head_dim}")
        if self.index_kpool < 1:
            raise ConfigError(f"index_kpool must be positive, got {self.index_kpool}")
        if self.index_topk % self.index_kpool:
            raise ConfigError(f"index_topk ({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("group-limited routing needs at least 2 experts per group (n_routed_experts / n_group)")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id ({self.pad_token_id}) must be null or in [0, vocab_size={self.vocab_size})")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ConfigError("hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.linear_conv_kernel_dim < 1:
            raise ConfigError("linear_conv_kernel_dim must be >= 1")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "v_head_dim", "index_n_heads", "index_head_dim", "linear_num_heads", "linear_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("layer_types", "indexer_types", "mlp_layer_types", "eos_token_id"):
            d[k] = list(d[k])
        d.update(model_type="glm5_next_text", head_dim=self.qk_rope_head_dim, num_local_experts=self.n_routed_experts)
        return d


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (`vision_config`)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    image_size: int = 336
    swiglu_limit: float | None = 10.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in known if k in d and d[k] is not None}
        if "num_attention_heads" in d and "num_heads" not in d:
            kw["num_heads"] = d["num_attention_heads"]
        rope = d.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kw["rope_theta"] = float(rope["rope_theta"])
        for k in ("patch_size", "temporal_patch_size", "image_size"):
            if isinstance(kw.get(k), (list, tuple)):
                kw[k] = int(kw[k][0])
        cfg = cls(**kw)
        if cfg.hidden_size % cfg.num_heads:
            raise ConfigError(f"vision_config.hidden_size ({cfg.hidden_size}) must be divisible by num_heads")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("rope_theta")
        d.update(model_type="glm5_next_vision",
                 rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})
        return d


_TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                    "video_start_token_id", "video_end_token_id")


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint's config: text model, optional vision tower, token ids, quantisation."""

    text: TextConfig
    vision: VisionConfig | None = None
    image_token_id: int = 154854
    video_token_id: int = 154855
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833
    quantization: QuantConfig | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        if "text_config" in d and d["text_config"] is not None:
            text_d = dict(d["text_config"])
            # Fields SGLang-style configs keep at the top level still apply to the text model.
            for k in ("num_nextn_predict_layers", "first_k_dense_replace", "linear_attn_config",
                      "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"):
                if k in d and k not in text_d:
                    text_d[k] = d[k]
        else:
            text_d = d  # flat, text-only form
        text = TextConfig.from_dict(text_d)
        vision = VisionConfig.from_dict(d["vision_config"]) if d.get("vision_config") else None
        if vision is not None and vision.out_hidden_size != text.hidden_size:
            raise ConfigError(f"vision_config.out_hidden_size ({vision.out_hidden_size}) must equal "
                              f"text hidden_size ({text.hidden_size}): merged image features replace token embeddings")
        ids = {k: int(d[k]) for k in _TOKEN_ID_FIELDS if d.get(k) is not None}
        for k, v in ids.items():
            if vision is not None and not 0 <= v < text.vocab_size:
                raise ConfigError(f"{k} ({v}) is outside the vocabulary (vocab_size={text.vocab_size})")
        qd = d.get("quantization_config") or text_d.get("quantization_config")
        quant = QuantConfig.from_dict(qd) if qd else None
        return cls(text=text, vision=vision, quantization=quant, extra=d, **ids)

    def to_dict(self) -> dict[str, Any]:
        """The HF config.json form, every field explicit (plus the fields SGLang needs)."""
        t = self.text
        d: dict[str, Any] = {
            "architectures": ["Glm5NextForConditionalGeneration"],
            "model_type": "glm5_next",
            "text_config": t.to_dict(),
            "tie_word_embeddings": t.tie_word_embeddings,
            "mhc": True,
            "index_kpool_compress": True,
            "num_nextn_predict_layers": t.num_nextn_predict_layers,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }
        if self.vision is not None:
            d["vision_config"] = self.vision.to_dict()
        for k in _TOKEN_ID_FIELDS:
            d[k] = getattr(self, k)
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        return d

    def replace_text(self, **kw: Any) -> "ModelConfig":
        text = dataclasses.replace(self.text, **kw)
        text.validate()
        return dataclasses.replace(self, text=text)


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"no config.json at {p}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    # Older ModelOpt (NVFP4) releases carry their quantization only in hf_quant_config.json.
    hq = os.path.join(os.path.dirname(p), "hf_quant_config.json")
    if isinstance(d, dict) and not d.get("quantization_config") and not (
            isinstance(d.get("text_config"), dict) and d["text_config"].get("quantization_config")) \
            and os.path.exists(hq):
        try:
            with open(hq, encoding="utf-8") as f:
                hd = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{hq} is not valid JSON: {e}") from e
        if isinstance(hd, dict) and isinstance(hd.get("quantization"), dict) \
                and hd["quantization"].get("quant_algo"):
            d = {**d, "quantization_config": {"quant_method": "modelopt", **hd}}
    try:
        return ModelConfig.from_dict(d)
    except TypeError as e:  # wrong value types reaching the dataclass
        raise ConfigError(f"{p}: {e}") from e
