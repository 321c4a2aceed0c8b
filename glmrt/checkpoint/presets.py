"""Named model shapes for random-weight checkpoints: `tiny`, `tiny-trained`, `flash-4l`, `flash-4l-mtp`,
`flash`.

`tiny` is the CPU test model (seconds to build; every feature on: both attention and
indexer types, dense + MoE with group routing, mHC, MTP, vision). `tiny-trained` is the shape
`glmrt train` trains (glmrt/train/). `flash-4l` has the full
layer widths with 4 layers (3 KDA + 1 DSA, all MoE; the GPU benchmark model); `flash-4l-mtp` is
`flash-4l` plus its MTP draft layer (speculative decoding on the GPU). `flash` is the full
45-layer GLM-5.3-Flash.
"""

from __future__ import annotations

from glmrt.checkpoint.tokenizer import token_id_config
from glmrt.config import DSA, KDA, ModelConfig

FULL_VOCAB = 154880


def _ids(vocab: int) -> tuple[dict, dict]:
    ids = token_id_config(vocab)
    text_ids = {"pad_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"]}
    top = {k: v for k, v in ids.items() if k.endswith("_token_id") and k not in text_ids}
    return text_ids, top


def _tiny() -> dict:
    vocab = 1024
    text_ids, top = _ids(vocab)
    text = {
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 6,
        "layer_types": [KDA, DSA, DSA, KDA, DSA, KDA],
        "indexer_types": ["full", "full", "shared", "full", "full", "full"],
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
        "index_n_heads": 16, "index_head_dim": 16, "index_topk": 16, "index_kpool": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
        "num_nextn_predict_layers": 1, **text_ids,
    }
    vision = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
              "projection_intermediate_size": 64, "patch_size": 4, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "image_size": 16}
    return {"text_config": text, "vision_config": vision, **top}


def _tiny_trained() -> dict:
    """The shape of the model `glmrt train` trains: every layer kind at ~1.35M parameters (under
    3 MB in bf16, the MTP layer included), heads, experts and vocab even for TP2, no vision."""
    vocab = 1024
    text_ids, top = _ids(vocab)
    text = {
        "vocab_size": vocab, "hidden_size": 96, "intermediate_size": 128, "moe_intermediate_size": 48,
        "num_hidden_layers": 6,
        "layer_types": [KDA, DSA, DSA, KDA, KDA, DSA],
        "indexer_types": ["full", "full", "shared", "full", "full", "full"],
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 48, "qk_nope_head_dim": 24, "qk_rope_head_dim": 0, "v_head_dim": 24,
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 32, "index_kpool": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
        "num_nextn_predict_layers": 1, **text_ids,
    }
    return {"text_config": text, **top}


def _flash(layers: int | None, mtp: bool = False) -> dict:
    text_ids, top = _ids(FULL_VOCAB)
    text: dict = {"vocab_size": FULL_VOCAB, **text_ids}
    if layers is None:
        text["num_nextn_predict_layers"] = 1
    else:
        text.update(num_hidden_layers=layers, layer_types=[KDA, KDA, KDA, DSA][:layers],
                    mlp_layer_types=["sparse"] * layers, indexer_types=["full"] * layers,
                    num_nextn_predict_layers=1 if mtp else 0)
    # NOTE: the merged image features replace token embeddings, so out_hidden_size must be
    # the text hidden size (HF's vision default of 1536 cannot run an image).
    vision = {"out_hidden_size": 4096}
    return {"text_config": text, "vision_config": vision, **top}


PRESETS = {"tiny": lambda: _tiny(), "tiny-trained": lambda: _tiny_trained(), "flash-4l": lambda: _flash(4),
           "flash-4l-mtp": lambda: _flash(4, mtp=True), "flash": lambda: _flash(None)}
LARGE_PRESETS = ("flash-4l", "flash-4l-mtp", "flash")


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name]())
