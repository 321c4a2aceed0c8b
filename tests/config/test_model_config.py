"""config.json parsing: nested/flat forms, HF's derivations, validation errors, round trip, HF parity."""

import json

import pytest
import torch

from glmrt.checkpoint.presets import preset_config
from glmrt.config import DSA, KDA, ConfigError, ModelConfig, QuantConfig, TextConfig, load_model_config

torch.set_num_threads(1)


def small_text(**over):
    """A small valid text config (6 layers: KDA, DSA, DSA, KDA, DSA, KDA)."""
    d = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "layer_types": [KDA, DSA, DSA, KDA, DSA, KDA],
        "indexer_types": ["full", "full", "shared", "full", "full", "full"],
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
        "index_n_heads": 16, "index_head_dim": 16, "index_topk": 16, "index_kpool": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
        "pad_token_id": 500, "eos_token_id": [500, 501],
    }
    d.update(over)
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()

SMALL_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                "projection_intermediate_size": 64, "patch_size": 4, "temporal_patch_size": 2,
                "spatial_merge_size": 2, "image_size": 16}


def hf_rule(i: int, freq: int, offset: int) -> str:
    return "full" if max(i - offset + 1, 0) % freq == 0 else "shared"


# ---- forms and defaults ---------------------------------------------------------------------

def test_nested_and_flat_forms_parse_to_the_same_text_config():
    t = small_text()
    nested = ModelConfig.from_dict({"text_config": t, "vision_config": SMALL_VISION, "image_token_id": 510})
    flat = ModelConfig.from_dict(t)
    assert nested.text == flat.text
    assert nested.text.hidden_size == 64 and nested.text.layer_types[1] == DSA
    assert nested.vision is not None and nested.vision.depth == 2 and flat.vision is None
    assert nested.image_token_id == 510


def test_sglang_top_level_fields_apply_to_nested_text_config():
    t = small_text(layer_types=[DSA] * 6, indexer_types=_DROP)
    cfg = ModelConfig.from_dict({"text_config": t, "index_topk_pattern": "FSFSSF", "num_nextn_predict_layers": 1})
    assert cfg.text.indexer_types == ("full", "shared", "full", "shared", "shared", "full")
    assert cfg.text.num_nextn_predict_layers == 1


def test_full_size_defaults():
    t = TextConfig.from_dict({})
    assert t.num_hidden_layers == 45
    assert t.dsa_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43)
    assert len(t.dsa_layers) == 11 and len(t.kda_layers) == 34
    assert all(t.layer_types[i] == (DSA if i % 4 == 3 else KDA) for i in range(45))
    assert t.mlp_layer_types[:3] == ("dense",) * 3 and t.mlp_layer_types[3:] == ("sparse",) * 42
    assert [i for i in range(45) if not t.is_moe(i)] == [0, 1, 2]
    assert t.indexer_types == ("full",) * 45 and t.indexer_layers == t.dsa_layers
    assert t.num_attention_heads == t.num_key_value_heads == 64
    assert (t.qk_rope_head_dim, t.qk_head_dim, t.linear_qkv_dim) == (0, 256, 8192)
    assert (t.n_routed_experts, t.num_experts_per_tok, t.linear_lower_bound) == (288, 8, -5.0)
    assert t.index_topk_pools == 2048 // 16


def test_first_k_dense_replace():
    t = TextConfig.from_dict({"first_k_dense_replace": 1, "num_hidden_layers": 8})
    assert t.mlp_layer_types == ("dense",) + ("sparse",) * 7


# ---- indexer schedule ---------------------------------------------------------------------------

def test_index_topk_pattern():
    t = TextConfig.from_dict(small_text(layer_types=[DSA] * 6, indexer_types=_DROP, index_topk_pattern="FFSFSS"))
    assert t.indexer_types == ("full", "full", "shared", "full", "shared", "shared")
    assert t.indexer_layers == (0, 1, 3)


def test_index_topk_pattern_rejects_unknown_letters():
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        TextConfig.from_dict(small_text(layer_types=[DSA] * 6, indexer_types=_DROP, index_topk_pattern="FFXFFF"))


def test_explicit_indexer_types_win_over_pattern():
    t = TextConfig.from_dict(small_text(layer_types=[DSA] * 6, indexer_types=["full"] * 6,
                                        index_topk_pattern="FSSSSS"))
    assert t.indexer_types == ("full",) * 6


@pytest.mark.parametrize("freq,offset", [(1, 2), (2, 2), (3, 1), (4, 3), (2, 1), (3, 5)])
def test_index_topk_freq_and_offset(freq, offset):
    n = 12
    t = TextConfig.from_dict(small_text(num_hidden_layers=n, layer_types=[DSA] * n, indexer_types=_DROP,
                                        mlp_layer_types=_DROP, index_topk_freq=freq, index_skip_topk_offset=offset))
    assert list(t.indexer_types) == [hf_rule(i, freq, offset) for i in range(n)]
    if freq > 1:
        assert "shared" in t.indexer_types


def test_index_topk_freq_defaults_give_all_full():
    t = TextConfig.from_dict(small_text(num_hidden_layers=8, layer_types=[DSA] * 8, indexer_types=_DROP,
                                        mlp_layer_types=_DROP))
    assert t.indexer_types == ("full",) * 8


# ---- linear_attn_config and aliases ------------------------------------------------------------

def test_linear_attn_config_overrides():
    la = {"head_dim": 32, "num_heads": 8, "short_conv_kernel_size": 3, "gate_lower_bound": -3.0}
    t = TextConfig.from_dict(small_text(linear_attn_config=la))
    assert (t.linear_head_dim, t.linear_num_heads, t.linear_conv_kernel_dim, t.linear_lower_bound) == (32, 8, 3, -3.0)
    assert t.linear_qkv_dim == 256


def test_linear_attn_config_safe_gate_null_bound_means_minus_five():
    t = TextConfig.from_dict(small_text(linear_lower_bound=None,
                                        linear_attn_config={"safe_gate": True, "gate_lower_bound": None}))
    assert t.linear_lower_bound == -5.0
    # without safe_gate a null bound stays null (the softplus gate)
    t = TextConfig.from_dict(small_text(linear_lower_bound=None,
                                        linear_attn_config={"safe_gate": False, "gate_lower_bound": None}))
    assert t.linear_lower_bound is None
    # a null bound without linear_attn_config is kept as given
    assert TextConfig.from_dict(small_text(linear_lower_bound=None)).linear_lower_bound is None


def test_linear_attn_config_full_attn_layers_give_the_schedule():
    t = TextConfig.from_dict(small_text(layer_types=_DROP, indexer_types=_DROP,
                                        linear_attn_config={"full_attn_layers": [1, 2, 4]}))
    assert t.dsa_layers == (1, 2, 4)


def test_full_attention_alias():
    t = TextConfig.from_dict(small_text(layer_types=[KDA, "full_attention", DSA, KDA, "full_attention", KDA]))
    assert t.layer_types == (KDA, DSA, DSA, KDA, DSA, KDA)
    assert t.dsa_layers == (1, 2, 4)


def test_num_local_experts_alias():
    t = TextConfig.from_dict(small_text(n_routed_experts=_DROP, num_local_experts=16))
    assert t.n_routed_experts == 16
    # n_routed_experts wins when both are given
    assert TextConfig.from_dict(small_text(num_local_experts=16)).n_routed_experts == 8


# ---- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("over,field", [
    ({"layer_types": [KDA, DSA, DSA, KDA, DSA]}, "layer_types"),
    ({"mlp_layer_types": ["dense"] * 7}, "mlp_layer_types"),
    ({"layer_types": [KDA, DSA, "mamba", KDA, DSA, KDA]}, r"layer_types\[2\]"),
    ({"indexer_types": ["full", "full", "full", "full", "shared", "full"]}, r"indexer_types\[4\]"),
    ({"layer_types": [DSA, DSA, DSA, KDA, DSA, KDA], "indexer_types": ["shared"] + ["full"] * 5},
     r"indexer_types\[0\]"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
    ({"index_topk": 18}, "index_topk"),
    ({"pad_token_id": 512}, "pad_token_id"),
    ({"pad_token_id": _DROP}, "pad_token_id"),  # the full-size default 154820 is outside vocab 512
])
def test_validation_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({"text_config": small_text(**over)})


def test_shared_after_shared_is_allowed():
    t = TextConfig.from_dict(small_text(layer_types=[DSA] * 6, indexer_types=["full", "shared", "shared"] * 2))
    assert t.indexer_layers == (0, 3)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_vision_out_hidden_size_must_match_text_hidden_size():
    vision = dict(SMALL_VISION, out_hidden_size=32)
    with pytest.raises(ConfigError, match="out_hidden_size"):
        ModelConfig.from_dict({"text_config": small_text(), "vision_config": vision})


def test_load_model_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model_config(tmp_path)  # no config.json in the directory
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 512,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError):
        load_model_config(tmp_path)


def test_load_model_config_reads_dir_or_file(tmp_path):
    d = {"text_config": small_text(), "vision_config": SMALL_VISION}
    (tmp_path / "config.json").write_text(json.dumps(d))
    a = load_model_config(tmp_path)
    b = load_model_config(tmp_path / "config.json")
    assert a == b == ModelConfig.from_dict(d)


# ---- round trip -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "flash-4l", "flash-4l-mtp", "flash"])
def test_to_dict_from_dict_round_trip(name):
    cfg = preset_config(name)
    d = cfg.to_dict()
    back = ModelConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.text == cfg.text and back.vision == cfg.vision
    # every text field is written explicitly
    for f in ("layer_types", "indexer_types", "mlp_layer_types", "pad_token_id", "eos_token_id",
              "linear_lower_bound", "swiglu_limit", "num_nextn_predict_layers"):
        assert f in d["text_config"], f
    if name.startswith("flash-4l"):  # flash-4l-mtp is flash-4l plus its draft layer
        assert cfg.text.num_nextn_predict_layers == (name == "flash-4l-mtp")
        assert cfg.replace_text(num_nextn_predict_layers=0) == preset_config("flash-4l")


def test_round_trip_with_quantization_and_null_fields():
    cfg = ModelConfig.from_dict({
        "text_config": small_text(linear_lower_bound=None, swiglu_limit=None, pad_token_id=None),
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                "ignored_layers": ["lm_head"], "scale_fmt": "ue8m0"},
    })
    assert cfg.quantization == QuantConfig(ignored=("lm_head",), scale_fmt="ue8m0")
    assert cfg.text.linear_lower_bound is None and cfg.text.swiglu_limit is None and cfg.text.pad_token_id is None
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_unsupported_quant_method():
    with pytest.raises(ConfigError, match="quant_method"):
        ModelConfig.from_dict({"text_config": small_text(), "quantization_config": {"quant_method": "awq"}})


# ---- HF accepts what we write, and derives what we derive ---------------------------------------------

@pytest.fixture(scope="module")
def hf_config():
    transformers = pytest.importorskip("transformers")
    return transformers.Glm5NextConfig, transformers.Glm5NextTextConfig


@pytest.mark.parametrize("cfg", [
    preset_config("tiny"),
    preset_config("flash"),
    ModelConfig.from_dict({"text_config": small_text(layer_types=[DSA, DSA, KDA, DSA, DSA, DSA],
                                                     indexer_types=["full", "shared", "full", "full", "shared",
                                                                    "full"])}),
], ids=["tiny", "flash", "shared"])
def test_hf_config_accepts_our_to_dict(hf_config, cfg):
    Glm5NextConfig, _ = hf_config
    hf = Glm5NextConfig(**cfg.to_dict())
    tc = hf.text_config
    assert list(tc.layer_types) == list(cfg.text.layer_types)
    assert list(tc.indexer_types) == list(cfg.text.indexer_types)
    assert list(tc.mlp_layer_types) == list(cfg.text.mlp_layer_types)
    assert tc.num_hidden_layers == cfg.text.num_hidden_layers
    assert tc.n_routed_experts == cfg.text.n_routed_experts
    assert tc.linear_lower_bound == cfg.text.linear_lower_bound
    assert tc.qk_head_dim == cfg.text.qk_head_dim and tc.head_dim == 0
    assert hf.image_token_id == cfg.image_token_id
    if cfg.vision is not None:
        assert hf.vision_config.out_hidden_size == cfg.vision.out_hidden_size == cfg.text.hidden_size


@pytest.mark.parametrize("extra", [
    {"index_topk_pattern": "FSFFSS", "layer_types": [DSA] * 6},
    {"index_topk_freq": 3, "index_skip_topk_offset": 1, "layer_types": [DSA] * 6},
    {"layer_types": [KDA, "full_attention", DSA, KDA, DSA, KDA], "indexer_types": ["full"] * 6},
    {"linear_attn_config": {"head_dim": 32, "num_heads": 8, "short_conv_kernel_size": 3, "safe_gate": True,
                            "gate_lower_bound": None}, "linear_lower_bound": None},
], ids=["pattern", "freq", "alias", "linear_attn"])
def test_same_derivations_as_hf(hf_config, extra):
    _, Glm5NextTextConfig = hf_config
    raw = small_text(**{"indexer_types": _DROP, **extra})
    ours = TextConfig.from_dict(raw)
    hf = Glm5NextTextConfig(**raw)
    assert list(hf.layer_types) == list(ours.layer_types)
    assert list(hf.indexer_types) == list(ours.indexer_types)
    assert list(hf.mlp_layer_types) == list(ours.mlp_layer_types)
    assert (hf.linear_head_dim, hf.linear_num_heads, hf.linear_conv_kernel_dim, hf.linear_lower_bound) == \
        (ours.linear_head_dim, ours.linear_num_heads, ours.linear_conv_kernel_dim, ours.linear_lower_bound)
