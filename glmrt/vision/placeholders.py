"""Placeholder expansion: a prompt's image and video placeholder tokens become as many
vision tokens as the processed items fill, plus the conversion of items to model tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from glmrt.vision.processor import ProcessedImage, ProcessedVideo
from glmrt.vision.processor_config import _get


_TOKEN_KEYS = {
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
}


def token_ids_from_config(model_config: Any) -> dict[str, int]:
    """The six vision token ids of a `glmrt.config.ModelConfig` (or a config.json dict)."""
    out = {}
    for k in _TOKEN_KEYS:
        v = _get(model_config, k)
        if v is None:
            raise ValueError(f"model config has no {k}")
        out[k] = int(v)
    return out


def _resolve_token_ids(token_ids: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for key, text in _TOKEN_KEYS.items():
        v = token_ids.get(key, token_ids.get(text))
        if v is None:
            raise ValueError(f"token_ids lacks {key!r} (or {text!r})")
        out[key] = int(v)
    return out


def expand_placeholders(
    prompt_ids: Sequence[int],
    items: Sequence[ProcessedImage | ProcessedVideo],
    token_ids: Mapping[str, int],
    encode: Callable[[str], list[int]] | None = None,
) -> list[int]:
    """Expands the prompt's visual placeholders, in order, for `items` (same order).

    ``<|begin_of_image|><|image|><|end_of_image|>`` -> the image token repeated num_tokens
    times between the same begin/end. ``<|begin_of_video|><|video|><|end_of_video|>`` -> per
    temporal group ``<|begin_of_image|>`` + image token x tokens_per_frame + ``<|end_of_image|>``
    + encode(f"{timestamp:.1f} seconds"), all inside the begin/end-of-video pair (video
    positions use the image token id). `token_ids` takes the config field names
    (image_token_id, video_token_id, image_start_token_id, image_end_token_id,
    video_start_token_id, video_end_token_id) or the token strings. Raises ValueError when
    placeholders and items disagree in number or kind, or a placeholder is malformed.
    """
    t = _resolve_token_ids(token_ids)
    img, vid = t["image_token_id"], t["video_token_id"]
    boi, eoi = t["image_start_token_id"], t["image_end_token_id"]
    bov, eov = t["video_start_token_id"], t["video_end_token_id"]
    ids = list(prompt_ids)
    n = len(ids)

    slots: list[tuple[int, str]] = []
    for pos, tok in enumerate(ids):
        if tok == img:
            if not (0 < pos < n - 1 and ids[pos - 1] == boi and ids[pos + 1] == eoi):
                raise ValueError(f"image placeholder at position {pos} is not "
                                 f"<|begin_of_image|><|image|><|end_of_image|>")
            slots.append((pos, "image"))
        elif tok == vid:
            if not (0 < pos < n - 1 and ids[pos - 1] == bov and ids[pos + 1] == eov):
                raise ValueError(f"video placeholder at position {pos} is not "
                                 f"<|begin_of_video|><|video|><|end_of_video|>")
            slots.append((pos, "video"))
    if len(slots) != len(items):
        n_img = sum(k == "image" for _, k in slots)
        raise ValueError(f"prompt has {n_img} image and {len(slots) - n_img} video placeholders "
                         f"but {len(items)} media items were given")

    out: list[int] = []
    prev = 0
    for (pos, kind), item in zip(slots, items):
        out.extend(ids[prev:pos])
        prev = pos + 1
        if kind == "image":
            if not isinstance(item, ProcessedImage):
                raise ValueError(f"placeholder at position {pos} is an image but the item is "
                                 f"{type(item).__name__}")
            out.extend([img] * item.num_tokens)
        else:
            if not isinstance(item, ProcessedVideo):
                raise ValueError(f"placeholder at position {pos} is a video but the item is "
                                 f"{type(item).__name__}")
            if encode is None:
                raise ValueError("expanding a video placeholder needs `encode` for its timestamps")
            groups = item.grid_thw[0]
            if len(item.timestamps) != groups:
                raise ValueError(f"video has {groups} temporal groups but {len(item.timestamps)} timestamps")
            per = item.tokens_per_frame
            for ts in item.timestamps:
                out.append(boi)
                out.extend([img] * per)
                out.append(eoi)
                out.extend(encode(f"{ts:.1f} seconds"))
    out.extend(ids[prev:])
    return out


# --------------------------------------------------------------------------------------------
# Torch conversion (model side only; torch imported lazily)
# --------------------------------------------------------------------------------------------

def to_torch(items: Sequence[ProcessedImage | ProcessedVideo], dtype: Any = None) -> tuple[Any, Any]:
    """Concatenates items' rows into one torch tensor [N, patch_dim] and their grids into a
    LongTensor [len(items), 3] -- the `pixel_values` / `*_grid_thw` layout HF's model takes."""
    import torch

    if not items:
        raise ValueError("to_torch needs at least one item")
    pv = torch.from_numpy(np.concatenate([np.asarray(it.pixel_values) for it in items], axis=0))
    if dtype is not None:
        pv = pv.to(dtype)
    grid = torch.tensor([list(it.grid_thw) for it in items], dtype=torch.long)
    return pv, grid
