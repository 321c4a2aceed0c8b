"""Parity of glmrt.model.vision.VisionTower against HF's Glm5Next vision tower + merger.

Weights travel through the checkpoint names HF's `save_pretrained` writes (`model.visual.*`),
so a naming or layout mismatch fails `load_state_dict(strict=True)`. Every HF vision parameter
is perturbed first so that a mis-mapped weight (e.g. two norms swapped) cannot hide behind
its identical init.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from glmrt.config import VisionConfig
from glmrt.model.vision import VisionTower, num_visual_tokens

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TEXT = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                    "linear_attention", "deepseek_sparse_attention", "linear_attention"],
    "indexer_types": ["full", "full", "shared", "full", "full", "full"],
    "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 16, "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-5, "pad_token_id": None, "tie_word_embeddings": False,
}
VISION = {
    "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
    "out_hidden_size": 64, "projection_intermediate_size": 64,
    "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
    "image_size": 16, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
}
TOKENS = dict(image_token_id=250, video_token_id=251, image_start_token_id=246, image_end_token_id=247,
              video_start_token_id=248, video_end_token_id=249, tie_word_embeddings=False)
PATCH_DIM = 3 * 2 * 4 * 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF model fp32 eager with perturbed vision weights, our tower loaded from its checkpoint)."""
    from bench.hf_reference import import_hf_torch_kda

    import_hf_torch_kda()  # the CPU oracle keeps torch KDA even where fla-core is installed
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(0)
    hf_cfg = Glm5NextConfig(text_config=TEXT, vision_config=VISION, **TOKENS)
    hf = Glm5NextForConditionalGeneration._from_config(hf_cfg, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.model.visual.parameters():
            p.add_(0.05 * torch.randn_like(p))

    out = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(out)
    prefix = "model.visual."
    sd = {}
    for f in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        sd.update({k[len(prefix):]: v for k, v in load_file(f).items() if k.startswith(prefix)})

    ours = VisionTower(VisionConfig.from_dict(hf_cfg.vision_config.to_dict())).eval()
    ours.load_state_dict(sd, strict=True)  # exact key set + shapes
    assert list(ours.buffers()) == []
    return hf, ours, sd


def _pixels(grid: list[list[int]], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, PATCH_DIM, generator=g)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (ours.float() - ref.float()).abs().max().item()
    return diff, diff / ref.float().abs().max().item()


def test_state_dict_names_match_checkpoint(models):
    _, ours, sd = models
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}
    assert tuple(sd["patch_embed.proj.weight"].shape) == (32, 3, 2, 4, 4)
    assert tuple(sd["downsample.weight"].shape) == (64, 32, 2, 2)


@pytest.mark.parametrize("grid,video", [
    ([[1, 4, 4]], False),
    ([[1, 4, 4], [1, 2, 6]], False),
    ([[2, 4, 4]], True),
])
def test_fp32_parity(models, grid, video):
    hf, ours, _ = models
    pixels, grid_thw = _pixels(grid, seed=len(grid) + 10 * video), torch.tensor(grid)
    with torch.no_grad():
        if video:
            ref = hf.model.get_video_features(pixels, grid_thw).pooler_output
        else:
            ref = hf.model.get_image_features(pixels, grid_thw).pooler_output
        ref = torch.cat(ref)
        got = ours(pixels, grid_thw)
    assert got.shape == ref.shape == (sum(num_visual_tokens(grid_thw)), 64)
    assert ours.num_visual_tokens(grid_thw) == [int(t * h * w // 4) for t, h, w in grid]
    abs_err, rel_err = _rel_err(got, ref)
    print(f"grid={grid} video={video}: max abs {abs_err:.3e}, rel {rel_err:.3e}, max|ref| {ref.abs().max():.3f}")
    assert rel_err <= 1e-5


def test_fp32_parity_swiglu_clamp_active(models):
    """With a small limit the clamps bite (pre-activations reach ~1 here) in blocks and merger."""
    hf, ours, sd = models
    limit = 0.3
    clamped = VisionTower(dataclasses.replace(ours.cfg, swiglu_limit=limit)).eval()
    clamped.load_state_dict(sd, strict=True)
    # NOTE: HF reads the limit from module attributes at call time; patch them for this test only.
    hf_mods = [b.mlp for b in hf.model.visual.blocks] + [hf.model.visual.merger]
    grid = [[1, 4, 4], [1, 2, 6]]
    pixels, grid_thw = _pixels(grid, seed=5), torch.tensor(grid)
    try:
        for mod in hf_mods:
            mod.swiglu_limit = limit
        with torch.no_grad():
            ref = torch.cat(hf.model.get_image_features(pixels, grid_thw).pooler_output)
            got = clamped(pixels, grid_thw)
            unclamped = ours(pixels, grid_thw)
    finally:
        for mod in hf_mods:
            mod.swiglu_limit = VISION["swiglu_limit"]
    abs_err, rel_err = _rel_err(got, ref)
    print(f"limit={limit}: max abs {abs_err:.3e}, rel {rel_err:.3e}")
    assert rel_err <= 1e-5
    assert _rel_err(unclamped, ref)[1] > 1e-3  # the clamp really changed the output


def test_mixed_batch_equals_items(models):
    """Image and video items in one call give each item's own result (no cross-item attention)."""
    _, ours, _ = models
    grid = [[1, 2, 6], [2, 4, 4], [1, 4, 2]]
    pixels = _pixels(grid, seed=7)
    with torch.no_grad():
        together = ours(pixels, torch.tensor(grid))
        parts = torch.split(pixels, [t * h * w for t, h, w in grid])
        alone = torch.cat([ours(p, torch.tensor([g])) for p, g in zip(parts, grid)])
    assert _rel_err(together, alone)[1] <= 1e-6


def test_bf16_smoke(models):
    hf, ours, sd = models
    grid = [[1, 4, 4], [2, 2, 6]]
    pixels, grid_thw = _pixels(grid, seed=3), torch.tensor(grid)
    ours_bf16 = VisionTower(ours.cfg).eval()
    ours_bf16.load_state_dict(sd, strict=True)
    ours_bf16.to(torch.bfloat16)
    hf_bf16 = copy.deepcopy(hf.model.visual).to(torch.bfloat16)
    with torch.no_grad():
        ref32 = ours(pixels, grid_thw)
        got = ours_bf16(pixels, grid_thw)  # fp32 pixels are cast to the weight dtype
        ref16 = hf_bf16(pixels.bfloat16(), grid_thw=grid_thw).pooler_output
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    abs_err, rel_err = _rel_err(got, ref32)
    # Not bitwise vs HF bf16 (linear vs conv, SDPA vs eager sum in different orders).
    abs16, rel16 = _rel_err(got, ref16)
    print(f"bf16 vs fp32: max abs {abs_err:.3e}, rel {rel_err:.3e}; vs HF bf16: abs {abs16:.3e}, rel {rel16:.3e}")
    assert rel_err <= 5e-2 and rel16 <= 5e-2
