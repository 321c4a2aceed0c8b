"""The vision preprocessing settings: `ImageProcessorConfig`, its HF defaults, and how it is
read from a checkpoint's config.json and processor JSON files (no numpy, no torch)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _scalar(v: Any) -> Any:
    return v[0] if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Preprocessing settings. Defaults are HF's Glm5Next processor defaults.

    Token budgets count *merged* tokens (one per 2x2 patch block per temporal group):
    images ``min_image_tokens..max_image_tokens`` each, videos
    ``min_video_tokens..max_video_tokens`` per clip (over all its temporal groups).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    min_video_tokens: int = 16
    max_video_tokens: int = 240000
    video_fps: float = 2.0
    max_video_frames: int = 2048
    # HF applies it to videos only (canvas factor patch*merge*expand); 1 in every released config.
    patch_expand_factor: int = 1

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens",
                     "max_image_tokens", "min_video_tokens", "max_video_tokens", "max_video_frames",
                     "patch_expand_factor"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ImageProcessorConfig.{name} must be a positive int, got {v!r}")
        if self.min_image_tokens > self.max_image_tokens:
            raise ValueError(f"min_image_tokens ({self.min_image_tokens}) > max_image_tokens ({self.max_image_tokens})")
        if self.min_video_tokens > self.max_video_tokens:
            raise ValueError(f"min_video_tokens ({self.min_video_tokens}) > max_video_tokens ({self.max_video_tokens})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or any(s <= 0 for s in self.image_std):
            raise ValueError("image_mean / image_std must have 3 entries (std > 0)")
        if not self.video_fps > 0 or not self.rescale_factor > 0:
            raise ValueError("video_fps and rescale_factor must be > 0")
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))

    @property
    def factor(self) -> int:
        """Canvas alignment for images: patch_size * merge_size (28)."""
        return self.patch_size * self.merge_size

    @property
    def video_factor(self) -> int:
        return self.patch_size * self.merge_size * self.patch_expand_factor

    @property
    def patch_dim(self) -> int:
        """Length of one patch row: 3 * temporal_patch_size * patch_size**2 (1176)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_vision_config(
        cls,
        vision_config: Any = None,
        preprocessor_config: Mapping[str, Any] | None = None,
        video_preprocessor_config: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> "ImageProcessorConfig":
        """Builds a config from a checkpoint's `vision_config` (a `glmrt.config.VisionConfig`,
        a dict, or anything with ``patch_size`` / ``temporal_patch_size`` / ``spatial_merge_size``
        attributes) plus optional HF ``preprocessor_config.json`` / ``video_preprocessor_config.json``
        dicts (their ``min/max_image_tokens`` are the image budget in the first and the *video*
        budget in the second). Explicit keyword overrides win."""
        kw: dict[str, Any] = {}
        if vision_config is not None:
            for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                                 ("merge_size", "spatial_merge_size")):
                v = _scalar(_get(vision_config, theirs))
                if v is not None:
                    kw[ours] = int(v)
        pp = dict(preprocessor_config or {})
        vp = dict(video_preprocessor_config or {})
        for src in (pp, vp):  # the vision tower's geometry must agree with the processors'
            for k in ("patch_size", "temporal_patch_size", "merge_size"):
                if src.get(k) is not None:
                    v = int(_scalar(src[k]))
                    if k in kw and kw[k] != v:
                        raise ValueError(f"processor {k}={v} disagrees with vision_config ({kw[k]})")
                    kw[k] = v
        for k in ("image_mean", "image_std"):
            if pp.get(k) is not None:
                kw[k] = tuple(pp[k])
        if pp.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(pp["rescale_factor"])
        for k in ("min_image_tokens", "max_image_tokens"):
            if pp.get(k) is not None:
                kw[k] = int(pp[k])
        if vp.get("min_image_tokens") is not None:
            kw["min_video_tokens"] = int(vp["min_image_tokens"])
        if vp.get("max_image_tokens") is not None:
            kw["max_video_tokens"] = int(vp["max_image_tokens"])
        if vp.get("fps") is not None:
            kw["video_fps"] = float(vp["fps"])
        if vp.get("max_frames") is not None:
            kw["max_video_frames"] = int(vp["max_frames"])
        if vp.get("patch_expand_factor") is not None:
            kw["patch_expand_factor"] = int(vp["patch_expand_factor"])
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, **overrides: Any) -> "ImageProcessorConfig":
        """Reads ``config.json``'s ``vision_config`` and, when present, ``preprocessor_config.json``,
        ``video_preprocessor_config.json`` or a combined ``processor_config.json``."""

        def load(name: str) -> dict[str, Any] | None:
            p = os.path.join(path, name)
            if not os.path.isfile(p):
                return None
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
            if not isinstance(d, dict):
                raise ValueError(f"{p} must hold a JSON object")
            return d

        cfg = load("config.json") or {}
        pp = load("preprocessor_config.json")
        vp = load("video_preprocessor_config.json")
        combined = load("processor_config.json") or {}
        if pp is None and isinstance(combined.get("image_processor"), dict):
            pp = combined["image_processor"]
        if vp is None and isinstance(combined.get("video_processor"), dict):
            vp = combined["video_processor"]
        return cls.from_vision_config(cfg.get("vision_config"), pp, vp, **overrides)
