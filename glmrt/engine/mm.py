"""Multimodal inputs of a request: pixel patches in, embeddings at the placeholder positions out.

The tokenizer expands each image (or video) placeholder into `num_tokens` image tokens; the
engine runs the vision tower once per request (at its first scheduled chunk) and the runner
writes the embeddings over those positions' token embeddings, in prompt order (HF's
masked-scatter order). For the prefix cache the placeholder tokens of an item are replaced
by a hash of its pixels, so two different images never share KV or state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class MMInput:
    kind: str                      # "image" | "video"
    pixel_values: torch.Tensor | None   # [patches, C*T*p*p]; None when a vision actor sent `embeds`
    grid_thw: tuple[int, int, int]
    num_tokens: int
    embeds: torch.Tensor | None = None  # [num_tokens, hidden] computed by a separate vision actor

    def content_key(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.kind, tuple(self.grid_thw))).encode())
        data = self.pixel_values if self.pixel_values is not None else self.embeds
        h.update(data.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return -1 - (int.from_bytes(h.digest(), "little") >> 2)  # negative: never a vocabulary id


@dataclass
class MMState:
    items: list[MMInput]
    positions: torch.Tensor        # [total tokens] prompt positions of the items' tokens, in order
    embeds: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def placeholder_positions(prompt_ids: list[int], image_token_id: int, items: list[MMInput]) -> list[int]:
    pos = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    want = sum(it.num_tokens for it in items)
    if len(pos) != want:
        raise ValueError(f"the prompt has {len(pos)} image placeholder tokens but its {len(items)} image/video "
                         f"item(s) need {want}")
    return pos


def cache_key_ids(prompt_ids: list[int], positions: list[int], items: list[MMInput]) -> list[int]:
    key = list(prompt_ids)
    k = 0
    for it in items:
        h = it.content_key()
        for p in positions[k:k + it.num_tokens]:
            key[p] = h
        k += it.num_tokens
    return key
