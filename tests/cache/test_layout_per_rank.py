"""The pools of one rank of a tensor-parallel group: KDA state split by head, the MLA latent and
the indexer keys replicated (every rank pays for them in full)."""

from __future__ import annotations

import pytest
import torch

from glmrt.cache.layout import CacheLayout
from glmrt.cache.pools import ModelCache
from glmrt.checkpoint.presets import preset_config
from glmrt.engine.memory import plan_memory


def test_flash_state_is_split_by_head_and_the_latent_is_not():
    text = preset_config("flash").text
    whole = CacheLayout.from_config(text, page_size=64)
    rank = CacheLayout.from_config(text, page_size=64, tp_size=8)
    assert (rank.kda_heads, rank.conv_dim) == (64 // 8, 3 * (64 // 8) * 128)
    assert rank.recurrent_bytes_per_slot * 8 == whole.recurrent_bytes_per_slot
    assert rank.conv_bytes_per_slot * 8 == whole.conv_bytes_per_slot
    assert rank.tail_bytes_per_slot == whole.tail_bytes_per_slot  # the indexer is replicated
    assert rank.kv_bytes_per_page == whole.kv_bytes_per_page  # latent + pooled keys on every rank
    budget = 40 << 30
    assert plan_memory(rank, budget).num_slots > 7 * plan_memory(whole, budget).num_slots


def test_a_rank_count_that_does_not_divide_the_kda_heads_is_refused():
    with pytest.raises(ValueError, match=r"linear_num_heads \(64\) is not divisible by 3 ranks"):
        CacheLayout.from_config(preset_config("flash").text, tp_size=3)


def test_model_cache_tensors_have_the_rank_shapes():
    text = preset_config("tiny").text
    cache = ModelCache.allocate(text, 4, 2, "cpu", page_size=16, with_mtp=True, tp_size=2)
    assert tuple(cache.recurrent(0).shape) == (2, text.linear_num_heads // 2, 16, 16)
    assert cache.conv(0).shape[-1] == 3 * text.linear_qkv_dim // 2
    assert cache.latent(1).shape[-1] == text.kv_lora_rank
    assert cache.latent(1).dtype == torch.bfloat16
