"""The physical pools: tensors only, no allocation policy (the engine's managers own that).

KVPool    paged, DSA layers: latent [L_dsa, pages, page_size, R] and pooled indexer keys
          [L_idx, pages, page_size // kpool, di] (one per complete k-pool).
StatePool request-local slots: KDA conv [L_kda, slots, K-1, 3*qkv] and recurrent state
          [L_kda, slots, H, dk, dv], plus the indexer tail [L_idx, slots, kpool, di] (k and g),
          and the final hidden state of the slot's last position [1, slots, D]: a prompt-end
          checkpoint keeps it, so an exact repeat of the prompt samples its first token
          without computing anything.
ModelCache maps a model layer index to its view of both pools. With the MTP draft layer (speculative
          decoding) it also holds the draft chain's indexer tail [slots, kpool, di] (k and g): the
          draft steps of one decode step write their speculative keys there, never into the
          slot's own tail, so the slot keeps the draft layer's state at its accepted position.
"""

from __future__ import annotations

import torch

from glmrt.cache.layout import CacheLayout
from glmrt.config import TextConfig

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp8_e4m3": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class KVPool:
    def __init__(self, layout: CacheLayout, num_pages: int, device: torch.device | str):
        self.layout = layout
        self.num_pages = num_pages
        if layout.kv_dtype == "fp8_e4m3":  # e4m3 values + fp32 group scales in one byte row
            self.latent = torch.zeros(layout.num_dsa, num_pages, layout.page_size, layout.latent_row_bytes,
                                      dtype=torch.uint8, device=device)
        else:
            self.latent = torch.zeros(layout.num_dsa, num_pages, layout.page_size, layout.kv_lora_rank,
                                      dtype=torch_dtype(layout.kv_dtype), device=device)
        self.pooled = torch.zeros(layout.num_indexer, num_pages, layout.pools_per_page, layout.index_head_dim,
                                  dtype=torch_dtype(layout.index_dtype), device=device)

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + self.pooled.nbytes


class StatePool:
    def __init__(self, layout: CacheLayout, num_slots: int, device: torch.device | str):
        self.layout = layout
        self.num_slots = num_slots
        self.conv = torch.zeros(layout.num_kda, num_slots, layout.conv_width, layout.conv_dim,
                                dtype=torch_dtype(layout.conv_dtype), device=device)
        self.recurrent = torch.zeros(layout.num_kda, num_slots, layout.kda_heads, layout.kda_dk, layout.kda_dv,
                                     dtype=torch_dtype(layout.state_dtype), device=device)
        tail_dt = torch_dtype(layout.index_dtype)
        self.tail_k = torch.zeros(layout.num_indexer, num_slots, layout.kpool, layout.index_head_dim,
                                  dtype=tail_dt, device=device)
        self.tail_g = torch.zeros_like(self.tail_k)
        self.last_hidden = torch.zeros(1, num_slots, layout.hidden_size, dtype=torch_dtype(layout.conv_dtype),
                                       device=device)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conv, self.recurrent, self.tail_k, self.tail_g, self.last_hidden)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one request's whole state (a prefix-cache checkpoint restore or save)."""
        for t in self.tensors:
            t[:, dst] = t[:, src]


class ModelCache:
    """Both pools plus the map from model layer index to pool ordinal."""

    def __init__(self, text: TextConfig, kv: KVPool, state: StatePool, with_mtp: bool = False):
        self.kv = kv
        self.state = state
        self.page_size = kv.layout.page_size
        self._dsa = {layer: i for i, layer in enumerate(text.dsa_layers)}
        self._idx = {layer: i for i, layer in enumerate(text.indexer_layers)}
        self._kda = {layer: i for i, layer in enumerate(text.kda_layers)}
        self.mtp_layer = text.num_hidden_layers if with_mtp else None
        self.capture = None  # a verify forward's glmrt.engine.rollback.Capture while it runs
        self.chain_tail_k = self.chain_tail_g = None
        if with_mtp:  # the draft layer takes the last DSA and indexer ordinals
            mtp = text.num_hidden_layers
            self._dsa[mtp] = len(text.dsa_layers)
            self._idx[mtp] = len(text.indexer_layers)
            self.chain_tail_k = torch.zeros_like(state.tail_k[self._idx[mtp]])
            self.chain_tail_g = torch.zeros_like(self.chain_tail_k)

    @classmethod
    def allocate(cls, text: TextConfig, num_pages: int, num_slots: int, device: torch.device | str, *,
                 page_size: int = 64, kv_dtype: str = "bfloat16", state_dtype: str = "float32",
                 model_dtype: str = "bfloat16", with_mtp: bool = False, tp_size: int = 1) -> "ModelCache":
        """Pools for one rank of a `tp_size` group (CacheLayout.from_config: KDA state per rank)."""
        layout = CacheLayout.from_config(text, page_size=page_size, kv_dtype=kv_dtype, state_dtype=state_dtype,
                                         model_dtype=model_dtype, with_mtp=with_mtp, tp_size=tp_size)
        return cls(text, KVPool(layout, num_pages, device), StatePool(layout, num_slots, device), with_mtp)

    def latent(self, layer: int) -> torch.Tensor:
        return self.kv.latent[self._dsa[layer]]

    def pooled(self, layer: int) -> torch.Tensor:
        return self.kv.pooled[self._idx[layer]]

    def tail(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._idx[layer]
        return self.state.tail_k[i], self.state.tail_g[i]

    def conv(self, layer: int) -> torch.Tensor:
        return self.state.conv[self._kda[layer]]

    @property
    def chain_bytes(self) -> int:
        """The draft chain's tails (beside the pools; speculative decoding only)."""
        return 0 if self.chain_tail_k is None else 2 * self.chain_tail_k.nbytes

    def draft_chain(self, slots: torch.Tensor | None, ops) -> "DraftChainCache":
        """The cache the draft chain's steps run on; `slots` (the first step's): copy their draft
        layer's accepted tail into the chain's tail first (the model's ops' slot copy)."""
        if slots is not None:
            k, g = self.tail(self.mtp_layer)
            ops.copy_slots((k[None], g[None]), slots, slots, into=(self.chain_tail_k[None], self.chain_tail_g[None]))
        return DraftChainCache(self)

    def recurrent(self, layer: int) -> torch.Tensor:
        return self.state.recurrent[self._kda[layer]]


class DraftChainCache:
    """A ModelCache whose draft layer's indexer tail is the chain's: the latent and pooled keys the
    chain writes past the accepted position are rewritten before anything reads them (the next
    forward's draft pass recomputes every accepted position), but the tail would lose the keys of
    accepted positions when a draft crosses a pool boundary."""

    def __init__(self, cache: ModelCache):
        self.cache = cache
        self.page_size = cache.page_size

    def latent(self, layer: int) -> torch.Tensor:
        return self.cache.latent(layer)

    def pooled(self, layer: int) -> torch.Tensor:
        return self.cache.pooled(layer)

    def tail(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert layer == self.cache.mtp_layer, "only the draft layer runs on the chain's cache"
        return self.cache.chain_tail_k, self.cache.chain_tail_g
