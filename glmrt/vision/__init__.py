"""Vision input handling for GLM-5.3-Flash: media loading and preprocessing (numpy/PIL, no torch)."""

from glmrt.vision.processor import (
    ImageProcessorConfig,
    ProcessedImage,
    ProcessedVideo,
    expand_placeholders,
    fit_canvas,
    image_grid,
    process_image,
    process_video,
    sample_frame_indices,
    to_torch,
    token_ids_from_config,
    video_grid,
)

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
