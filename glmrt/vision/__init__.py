"""Vision input handling for GLM-5.3-Flash: media loading and preprocessing (numpy/PIL, no torch)."""

from glmrt.vision.placeholders import expand_placeholders, to_torch, token_ids_from_config
from glmrt.vision.processor import (
    ProcessedImage,
    ProcessedVideo,
    fit_canvas,
    image_grid,
    process_image,
    process_video,
    sample_frame_indices,
    video_grid,
)
from glmrt.vision.processor_config import ImageProcessorConfig

__all__ = [
    "ImageProcessorConfig",
    "ProcessedImage",
    "ProcessedVideo",
    "expand_placeholders",
    "fit_canvas",
    "image_grid",
    "process_image",
    "process_video",
    "sample_frame_indices",
    "to_torch",
    "token_ids_from_config",
    "video_grid",
]
