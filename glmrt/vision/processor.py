"""Vision preprocessing for GLM-5.3-Flash: images and videos to patch rows (canvas, grid, sampling).

Runs in the tokenizer process, which has no torch: everything here is numpy + PIL. The math
follows HF transformers 5.17's Glm5Next processors (docs/MODEL.md, vision input):

* **Canvas** (`fit_canvas`): the content keeps its aspect ratio and is resized (PIL bicubic,
  uint8) so that the canvas, aligned up to ``factor = patch_size * merge_size`` (28), stays
  inside a token budget; the content sits top-left and the rest of the canvas is raw 0 (black
  before normalisation). Images never get larger unless they are under the minimum budget.
* **Pixels**: rescale by 1/255, CLIP mean/std normalisation, float32.
* **Patch rows**, block-major: for each 2x2 merge block (row-major over blocks) its 4 patches
  (row-major); each row is one patch laid out (channel, t, y, x) = 3*2*14*14 = 1176 values.
  An image is one temporal group (its frame duplicated); a video has one group per 2 frames.
* **Video sampling** (`sample_frame_indices`): ~2 fps, at most 2048 frames, even count;
  the per-clip token cap (240000) shrinks the frame size, and -- only where even 28x28 frames
  would not fit, which HF rejects -- drops frames.

Parity: `process_image` reproduces HF's PIL image processor (`Glm5NextImageProcessorPil`)
bit for bit (same PIL resize on uint8, same float64 rescale then float32 normalise).
`process_video` reproduces HF's video processor's frame sampling, canvas, grid, layout and
(fused, float32) normalisation exactly; HF resizes video frames with torchvision's uint8
bicubic-antialias kernel where we use PIL's bicubic, which differs by at most one uint8 level
on a small fraction of pixels (frames that need no resize match exactly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from glmrt.vision.processor_config import ImageProcessorConfig

__all__ = [
    "ProcessedImage",
    "ProcessedVideo",
    "fit_canvas",
    "image_grid",
    "video_grid",
    "sample_frame_indices",
    "process_image",
    "process_video",
]


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------

@dataclass
class ProcessedImage:
    """pixel_values: float32 [h*w, patch_dim] (block-major rows); grid_thw = (1, h, w) in patches."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int

    @property
    def tokens_per_frame(self) -> int:
        return self.num_tokens


@dataclass
class ProcessedVideo:
    """pixel_values: float32 [T*h*w, patch_dim]; grid_thw = (T, h, w), T temporal groups of 2 frames.

    ``timestamps[i]`` (seconds) labels temporal group i (its first frame); ``frame_indices``
    are the indices of the sampled frames in the input list (2*T of them)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    num_tokens: int
    timestamps: list[float]
    frame_indices: list[int] = field(default_factory=list)

    @property
    def tokens_per_frame(self) -> int:
        """Merged tokens per temporal group."""
        return self.num_tokens // self.grid_thw[0]


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------

def _align_up(value: int | float, factor: int) -> int:
    return math.ceil(value / factor) * factor


def fit_canvas(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int = 28,
    temporal_factor: int = 2,
    min_tokens: int = 16,
    max_tokens: int = 8000,
) -> tuple[int, int]:
    """The aligned canvas (height, width) in pixels for `num_frames` frames of height x width.

    Budget in pixels: tokens * temporal_factor * factor**2 over ``aligned_frames`` (frames
    rounded to a multiple of temporal_factor, at least one group). Too small: scale up so the
    budget reaches the minimum. Too large: the largest content height whose aligned canvas
    (width following the aspect ratio, floored) fits, found by bisection. Raises ValueError
    when even one factor x factor canvas per group exceeds the budget.
    """
    if height < 1 or width < 1 or num_frames < 1:
        raise ValueError(f"bad visual size: {num_frames} frames of {height}x{width}")
    per_token = temporal_factor * factor * factor
    lo_px = min_tokens * per_token
    hi_px = max_tokens * per_token
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)

    h, w = _align_up(height, factor), _align_up(width, factor)
    if frames * h * w < lo_px:
        s = math.sqrt(lo_px / (num_frames * height * width))
        h = _align_up(max(1, math.ceil(height * s)), factor)
        w = _align_up(max(1, math.ceil(width * s)), factor)

    if frames * h * w > hi_px:
        if frames * factor * factor > hi_px:
            raise ValueError(f"max_tokens={max_tokens} cannot hold {frames} frames of even one "
                             f"{factor}x{factor} block each")
        best = (factor, factor)
        lo, hi = 1, height
        while lo <= hi:
            ch = (lo + hi) // 2
            cw = max(1, math.floor(width * ch / height))
            cand_h, cand_w = _align_up(ch, factor), _align_up(cw, factor)
            if frames * cand_h * cand_w <= hi_px:
                best = (cand_h, cand_w)
                lo = ch + 1
            else:
                hi = ch - 1
        h, w = best
    return h, w


def _content_size(num_frames: int, height: int, width: int, canvas: tuple[int, int],
                  factor: int, temporal_factor: int, min_tokens: int) -> tuple[int, int]:
    """Size of the resized content inside `canvas` (aspect kept; upscaling only under the minimum)."""
    ch_, cw_ = canvas
    s = min(ch_ / height, cw_ / width)
    if num_frames * height * width >= temporal_factor * factor * factor * min_tokens:
        s = min(1.0, s)
    return (max(1, min(ch_, math.floor(height * s))), max(1, min(cw_, math.floor(width * s))))


def image_grid(height: int, width: int, cfg: ImageProcessorConfig | None = None) -> tuple[int, int, int]:
    """grid_thw (1, h, w) in patches that `process_image` produces for a height x width image."""
    cfg = cfg or ImageProcessorConfig()
    ch, cw = fit_canvas(cfg.temporal_patch_size, height, width, factor=cfg.factor,
                        temporal_factor=cfg.temporal_patch_size,
                        min_tokens=cfg.min_image_tokens, max_tokens=cfg.max_image_tokens)
    return 1, ch // cfg.patch_size, cw // cfg.patch_size


def _video_groups_cap(cfg: ImageProcessorConfig) -> int:
    """Most temporal groups a clip can have: each needs at least one video_factor^2 block, the
    budget's unit (a merged token when patch_expand_factor is 1)."""
    return cfg.max_video_tokens


def video_grid(num_frames: int, height: int, width: int,
               cfg: ImageProcessorConfig | None = None) -> tuple[int, int, int]:
    """grid_thw (T, h, w) for `num_frames` already-sampled frames of height x width."""
    cfg = cfg or ImageProcessorConfig()
    tp = cfg.temporal_patch_size
    groups = min(-(-num_frames // tp), _video_groups_cap(cfg))
    n = min(num_frames, groups * tp)
    ch, cw = fit_canvas(n, height, width, factor=cfg.video_factor, temporal_factor=tp,
                        min_tokens=cfg.min_video_tokens, max_tokens=cfg.max_video_tokens)
    return groups, ch // cfg.patch_size, cw // cfg.patch_size


# --------------------------------------------------------------------------------------------
# Pixels
# --------------------------------------------------------------------------------------------

def _resize_uint8(rgb: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """PIL bicubic resize of an HxWx3 uint8 array (what HF's PIL backend does)."""
    from PIL import Image

    if rgb.shape[:2] == tuple(size_hw):
        return rgb
    img = Image.fromarray(rgb, mode="RGB") if rgb.shape[2] == 3 else Image.fromarray(rgb)
    return np.asarray(img.resize((size_hw[1], size_hw[0]), resample=Image.BICUBIC))


def _place(rgb: np.ndarray, canvas: tuple[int, int]) -> np.ndarray:
    """HxWx3 uint8 content -> canvas-sized HxWx3 uint8, content top-left, zeros elsewhere."""
    h, w = rgb.shape[:2]
    if (h, w) == tuple(canvas):
        return rgb
    out = np.zeros((canvas[0], canvas[1], rgb.shape[2]), dtype=np.uint8)
    out[:h, :w] = rgb
    return out


def _patch_rows(frames: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """(G, tp, C, H, W) float32 -> (G*gh*gw, C*tp*p*p) rows in block-major order."""
    g, tp, c, hh, ww = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = hh // p, ww // p
    x = frames.reshape(g, tp, c, gh // m, m, p, gw // m, m, p)
    # -> (g, block_row, block_col, m_row, m_col, c, t, y, x)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(g * gh * gw, c * tp * p * p)


def process_image(img: Any, cfg: ImageProcessorConfig | None = None) -> ProcessedImage:
    """One PIL image -> patch rows + grid; equals HF's `Glm5NextImageProcessorPil` output."""
    from PIL import Image

    cfg = cfg or ImageProcessorConfig()
    if not isinstance(img, Image.Image):
        raise TypeError(f"process_image expects a PIL.Image.Image, got {type(img).__name__}")
    if img.mode != "RGB":
        img = img.convert("RGB")
    width, height = img.size
    tp = cfg.temporal_patch_size
    canvas = fit_canvas(tp, height, width, factor=cfg.factor, temporal_factor=tp,
                        min_tokens=cfg.min_image_tokens, max_tokens=cfg.max_image_tokens)
    content = _content_size(tp, height, width, canvas, cfg.factor, tp, cfg.min_image_tokens)
    if content != (height, width):
        img = img.resize((content[1], content[0]), resample=Image.BICUBIC)
    rgb = _place(np.asarray(img, dtype=np.uint8), canvas)

    # HF PIL path: float64 rescale, cast to float32, then (x - mean) / std in float32.
    x = (rgb.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)
    chw = x.transpose(2, 0, 1)
    frames = np.broadcast_to(chw[None, None], (1, tp) + chw.shape)
    rows = _patch_rows(frames, cfg)
    gh, gw = canvas[0] // cfg.patch_size, canvas[1] // cfg.patch_size
    return ProcessedImage(pixel_values=rows, grid_thw=(1, gh, gw), num_tokens=gh * gw // cfg.merge_size**2)


def sample_frame_indices(
    total_frames: int,
    fps: float,
    *,
    target_fps: float = 2.0,
    max_frames: int = 2048,
    duration: float | None = None,
) -> list[int]:
    """Indices of the frames to keep, HF's Glm5Next `sample_frames` rule.

    Walks the frames keeping the first at or after each 1/target_fps step until the whole
    seconds of `duration` (default ``total_frames / fps``, what HF's decoders report) are
    covered; falls back to an even spread when that gives too few / too many; removes
    duplicates and repeats the last index to make the count even. Never empty (HF returns no
    frames for clips under 1/target_fps seconds; we keep the first frame, twice).
    """
    if total_frames < 1:
        raise ValueError("a video needs at least one frame")
    if not fps or fps <= 0 or not math.isfinite(fps):
        raise ValueError(f"bad video fps: {fps!r}")
    if duration is None:
        duration = total_frames / fps
    duration = duration or (round((total_frames - 1) / fps) + 1)
    max_seconds = int(duration)
    want = min(int(duration * target_fps), max_frames)

    step = 1 / fps
    if total_frames < want:
        idx = np.linspace(0, total_frames - 1, want, dtype=int).tolist()
    else:
        idx = []
        t_next = 0
        inv = 1 / target_fps
        for i in range(total_frames):
            if i * step >= t_next:
                t_next += inv
                idx.append(i)
                if t_next >= max_seconds:
                    break
    if len(idx) < want:
        lo, hi = (idx[0], idx[-1]) if idx else (0, total_frames - 1)
        idx = np.linspace(lo, hi, want, dtype=int).tolist()
    elif len(idx) > want:
        idx = np.linspace(0, total_frames - 1, want, dtype=int).tolist()

    uniq = list(dict.fromkeys(int(i) for i in idx)) or [0]
    if len(uniq) % 2:
        uniq.append(uniq[-1])
    return uniq


def process_video(
    frames: Sequence[np.ndarray] | np.ndarray,
    fps: float,
    cfg: ImageProcessorConfig | None = None,
    *,
    duration: float | None = None,
    sample: bool = True,
) -> ProcessedVideo:
    """Decoded RGB frames (HxWx3 uint8, all one size) at `fps` -> patch rows, grid, timestamps.

    Samples ~cfg.video_fps frames per second (`sample_frame_indices`; ``sample=False`` keeps
    every frame, padding an odd count with the last), pairs them into temporal groups and fits
    the clip into ``cfg.max_video_tokens`` by shrinking the frames; a clip with more groups
    than the budget can hold even at one block per frame keeps an even spread of groups.
    """
    cfg = cfg or ImageProcessorConfig()
    n_in = len(frames)
    if n_in == 0:
        raise ValueError("process_video got no frames")
    first = np.asarray(frames[0])
    if first.ndim != 3 or first.shape[2] != 3 or first.dtype != np.uint8:
        raise ValueError(f"video frames must be HxWx3 uint8, got {first.shape} {first.dtype}")
    height, width = first.shape[:2]
    for i in range(n_in):
        if np.shape(frames[i]) != first.shape:
            raise ValueError(f"video frame {i} has shape {np.shape(frames[i])}, frame 0 has {first.shape}")

    tp = cfg.temporal_patch_size
    if sample:
        idx = sample_frame_indices(n_in, fps, target_fps=cfg.video_fps,
                                   max_frames=cfg.max_video_frames, duration=duration)
    else:
        if not fps or fps <= 0:
            raise ValueError(f"bad video fps: {fps!r}")
        idx = list(range(n_in))
    if len(idx) % tp:
        idx += [idx[-1]] * (tp - len(idx) % tp)
    groups = len(idx) // tp
    cap = _video_groups_cap(cfg)
    if groups > cap:  # clamp: keep an even spread of whole groups
        keep = np.linspace(0, groups - 1, cap).round().astype(int)
        idx = [idx[g * tp + t] for g in keep for t in range(tp)]
        groups = cap

    n = len(idx)
    factor = cfg.video_factor
    canvas = fit_canvas(n, height, width, factor=factor, temporal_factor=tp,
                        min_tokens=cfg.min_video_tokens, max_tokens=cfg.max_video_tokens)
    content = _content_size(n, height, width, canvas, factor, tp, cfg.min_video_tokens)

    # HF video path (torch): fused rescale+normalise, (x - mean/r) / (std/r) in float32.
    inv_r = np.float32(1.0 / cfg.rescale_factor)
    mean = np.asarray(cfg.image_mean, dtype=np.float32) * inv_r
    std = np.asarray(cfg.image_std, dtype=np.float32) * inv_r
    gh, gw = canvas[0] // cfg.patch_size, canvas[1] // cfg.patch_size
    per_group = gh * gw
    rows = np.empty((groups * per_group, cfg.patch_dim), dtype=np.float32)
    group = np.empty((1, tp, 3, canvas[0], canvas[1]), dtype=np.float32)
    last_i = -1  # repeated indices are adjacent: convert each frame once
    for j, i in enumerate(idx):
        if i != last_i:
            rgb = _place(_resize_uint8(np.asarray(frames[i]), content), canvas)
            last_i, last = i, ((rgb.astype(np.float32) - mean) / std).transpose(2, 0, 1)
        group[0, j % tp] = last
        if j % tp == tp - 1:  # patchify group by group: peak memory ~ the output, not twice it
            g = j // tp
            rows[g * per_group:(g + 1) * per_group] = _patch_rows(group, cfg)
    timestamps = [float(idx[g * tp] / fps) for g in range(groups)]
    return ProcessedVideo(pixel_values=rows, grid_thw=(groups, gh, gw),
                          num_tokens=groups * gh * gw // cfg.merge_size**2,
                          timestamps=timestamps, frame_indices=[int(i) for i in idx])
