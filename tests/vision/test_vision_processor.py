"""glmrt.vision: preprocessing parity with HF's Glm5Next processors, placeholders, media loading.

The image oracle is HF's CPU (PIL) image processor, compared bit for bit. HF's video
processor needs torchvision (not a dependency here); its frame sampling is pinned by golden
indices recorded from it, its canvas rule by HF's own `smart_resize`, and its layout by a
static clip compared against the HF image processor (same canvas, same patch order).
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from glmrt.vision import (
    ImageProcessorConfig,
    ProcessedImage,
    ProcessedVideo,
    expand_placeholders,
    fit_canvas,
    image_grid,
    process_image,
    process_video,
    sample_frame_indices,
    token_ids_from_config,
    video_grid,
)
from glmrt.vision.media import MediaError, decode_video, load_image, load_video

av = pytest.importorskip("av")
hf_pil = pytest.importorskip("transformers.models.glm5_next.image_processing_pil_glm5_next")


@functools.lru_cache(maxsize=1)
def _hf_image_processor():
    return hf_pil.Glm5NextImageProcessorPil()


def _pattern(w: int, h: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    return np.stack([(xx * 7 + yy * 3) % 256, (xx * xx // 5 + yy) % 256, rng.integers(0, 256, (h, w))],
                    axis=-1).astype(np.uint8)


# ------------------------------------------------------------------------------------------------
# Images: exact parity with HF's PIL processor
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "w,h,mode",
    [
        (5, 3, "RGB"),        # tiny: scaled up to the 16-token minimum
        (1, 300, "RGB"),      # degenerate tall
        (333, 251, "RGB"),    # not a multiple of 28: aligned canvas, zero padding
        (1920, 200, "RGB"),   # wide
        (200, 1920, "RGB"),   # tall
        (100, 37, "L"),       # grayscale -> RGB
        (90, 60, "RGBA"),     # alpha dropped like HF
        (3000, 2400, "RGB"),  # huge: clamped to the 8000-token cap
    ],
)
def test_process_image_matches_hf_pil(w, h, mode):
    img = Image.fromarray(_pattern(w, h))
    if mode != "RGB":
        img = img.convert(mode)
    ref = _hf_image_processor()(img, return_tensors="np")
    ours = process_image(img)
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert np.array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.grid_thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    t, gh, gw = ours.grid_thw
    assert t == 1 and ours.num_tokens == gh * gw // 4
    assert image_grid(h, w) == ours.grid_thw
    assert 16 <= ours.num_tokens <= 8000
    if (w, h) == (3000, 2400):
        assert ours.num_tokens == 8000 and ours.grid_thw == (1, 160, 200)


def test_fit_canvas_matches_hf_smart_resize():
    rng = np.random.default_rng(1)
    for _ in range(300):
        frames = int(rng.choice([1, 2, 3, 8, 64, 2048]))
        h, w = (int(x) for x in rng.integers(1, 5000, 2))
        lo, hi = (16, 8000) if rng.random() < 0.5 else (16, 240000)
        ref = hf_pil.smart_resize(num_frames=frames, height=h, width=w, temporal_factor=2, factor=28,
                                  min_pixels=lo, max_pixels=hi)
        assert fit_canvas(frames, h, w, min_tokens=lo, max_tokens=hi) == ref, (frames, h, w, lo, hi)


def test_block_major_patch_layout():
    """Row r = block-major patch; each row is (channel, t, y, x) with both t equal for an image."""
    arr = _pattern(56, 56)
    out = process_image(Image.fromarray(arr), ImageProcessorConfig(min_image_tokens=1))
    assert out.grid_thw == (1, 4, 4)
    mean = np.float32([0.48145466, 0.4578275, 0.40821073])
    std = np.float32([0.26862954, 0.26130258, 0.27577711])
    x = ((arr.astype(np.float64) / 255).astype(np.float32) - mean) / std
    row = 0
    for by in range(2):
        for bx in range(2):
            for my in range(2):
                for mx in range(2):
                    y0, x0 = (by * 2 + my) * 14, (bx * 2 + mx) * 14
                    patch = x[y0:y0 + 14, x0:x0 + 14].transpose(2, 0, 1)  # (c, y, x)
                    want = np.stack([patch, patch], axis=1).reshape(-1)  # (c, t, y, x)
                    np.testing.assert_allclose(out.pixel_values[row], want, rtol=0, atol=1e-6)
                    row += 1


def test_config_from_vision_config_and_checkpoint(tmp_path):
    from glmrt.config import VisionConfig

    cfg = ImageProcessorConfig.from_vision_config(VisionConfig(patch_size=16, spatial_merge_size=2))
    assert (cfg.patch_size, cfg.merge_size, cfg.factor, cfg.patch_dim) == (16, 2, 32, 3 * 2 * 16 * 16)
    assert (cfg.max_image_tokens, cfg.max_video_tokens, cfg.video_fps, cfg.max_video_frames) == (8000, 240000, 2.0, 2048)
    cfg = ImageProcessorConfig.from_vision_config({"patch_size": [14, 14], "temporal_patch_size": 2,
                                                   "spatial_merge_size": 2},
                                                  {"max_image_tokens": 1000, "image_mean": [0.5] * 3},
                                                  {"max_image_tokens": 5000, "fps": 1})
    assert (cfg.patch_size, cfg.max_image_tokens, cfg.max_video_tokens, cfg.video_fps) == (14, 1000, 5000, 1.0)
    assert cfg.image_mean == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError):
        ImageProcessorConfig.from_vision_config({"patch_size": 14}, {"patch_size": 16})
    (tmp_path / "config.json").write_text('{"vision_config": {"patch_size": 14, "spatial_merge_size": 2}}')
    (tmp_path / "preprocessor_config.json").write_text('{"max_image_tokens": 4096}')
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    assert (cfg.max_image_tokens, cfg.max_video_tokens) == (4096, 240000)


# ------------------------------------------------------------------------------------------------
# Videos
# ------------------------------------------------------------------------------------------------

# Recorded from HF's Glm5NextVideoProcessor.sample_frames (metadata duration = frames / fps,
# as HF's PyAV/OpenCV/decord readers set it).
_HF_SAMPLES = {
    (3, 1.0): [0, 1, 2, 2],
    (9, 6.0): [0, 1, 3, 3],
    (40, 10.0): [0, 5, 10, 15, 20, 25, 30, 35],
    (61, 30.0): [0, 15, 30, 45],
    (100, 23.976): [0, 12, 24, 36, 48, 60, 72, 84],
    (151, 29.97): [0, 15, 30, 45, 60, 75, 90, 105, 120, 135],
    (47, 2.5): [0, 1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 15, 17, 18, 19, 20, 22, 23, 24, 25, 26,
                28, 29, 30, 31, 33, 34, 35, 36, 37, 39, 40, 41, 42, 44, 44],
}


def test_sample_frame_indices_match_hf():
    for (total, fps), want in _HF_SAMPLES.items():
        assert sample_frame_indices(total, fps) == want, (total, fps)
    big = sample_frame_indices(30000, 10.0)  # 3000 s: capped at 2048 frames
    assert len(big) == 2048 and big[:6] == [0, 14, 29, 43, 58, 73] and big[-4:] == [29955, 29969, 29984, 29999]
    assert sum(big) == 30717953
    # under 0.5 s HF samples nothing (and then fails); we keep the first frame, twice
    assert sample_frame_indices(5, 30.0) == [0, 0]


def _encode_mp4(frames: list[np.ndarray], rate: int, fmt: str = "mp4", codec: str = "mpeg4") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.height, s.width = frames[0].shape[:2]
        s.pix_fmt = "yuv420p"
        if codec == "mpeg4":
            s.options = {"qscale": "1"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_video_mp4_roundtrip_sampling_grid_timestamps():
    # 4 s at 10 fps; frame i is flat gray 6*i so the sampled frames can be told apart
    src = [np.full((48, 64, 3), 6 * i, np.uint8) for i in range(40)]
    frames, fps = load_video(_data_url(_encode_mp4(src, 10), "video/mp4"))
    assert fps == 10.0 and len(frames) == 40 and frames[0].shape == (48, 64, 3) and frames[0].dtype == np.uint8
    for i in (0, 13, 39):
        assert abs(float(frames[i].mean()) - 6 * i) < 3
    out = process_video(frames, fps)
    assert out.frame_indices == [0, 5, 10, 15, 20, 25, 30, 35]  # 2 fps
    assert out.grid_thw == (4, 4, 6)  # T = 8 frames / 2; 48x64 -> 56x84 canvas
    assert out.timestamps == [0.0, 1.0, 2.0, 3.0]
    assert out.num_tokens == 4 * 4 * 6 // 4 and out.tokens_per_frame == 6
    assert out.pixel_values.shape == (4 * 4 * 6, 1176) and out.pixel_values.dtype == np.float32
    assert video_grid(8, 48, 64) == out.grid_thw
    # group g, first patch (top-left content), t=0 vs t=1: frames 10g and 10g+5
    pv = out.pixel_values.reshape(4, 24, 3, 2, 14, 14)
    std0, mean0 = 0.26862954, 0.48145466
    for g in range(4):
        for t in range(2):
            level = float(pv[g, 0, 0, t].mean()) * std0 * 255 + mean0 * 255
            assert abs(level - 6 * (10 * g + 5 * t)) < 3


def test_static_video_equals_hf_image_layout():
    """Two identical frames form one temporal group laid out exactly like an HF image."""
    arr = _pattern(333, 251)
    ref = _hf_image_processor()(Image.fromarray(arr), return_tensors="np")
    out = process_video([arr, arr], 2.0, sample=False)
    assert out.grid_thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    # HF's video path fuses rescale into (x - 255*mean) / (255*std): float32 rounding only
    np.testing.assert_allclose(out.pixel_values, ref["pixel_values"], rtol=0, atol=2e-6)
    assert out.timestamps == [0.0] and out.num_tokens == process_image(Image.fromarray(arr)).num_tokens


def test_video_token_cap_clamps():
    # the default 240000-token cap shrinks big, long clips instead of rejecting them
    t, h, w = video_grid(2048, 1080, 1920)
    assert t == 1024 and t * h * w // 4 <= 240000 and h * w // 4 >= 200
    assert abs((w / h) - 1920 / 1080) < 0.2
    assert fit_canvas(2048, 1080, 1920, max_tokens=240000) == hf_pil.smart_resize(
        num_frames=2048, height=1080, width=1920, min_pixels=16, max_pixels=240000)

    frames = [np.full((224, 224, 3), i * 10, np.uint8) for i in range(16)]
    cfg = ImageProcessorConfig(max_video_tokens=40)
    out = process_video(frames, 2.0, cfg)  # 16 frames at 2 fps: all kept, 8 groups
    assert out.grid_thw[0] == 8 and out.num_tokens <= 40
    assert out.pixel_values.shape[0] == out.num_tokens * 4
    # fewer tokens than groups: HF would raise; we keep an even spread of groups
    out = process_video(frames, 2.0, ImageProcessorConfig(max_video_tokens=3, min_video_tokens=1))
    assert out.grid_thw == (3, 2, 2) and out.num_tokens == 3
    assert out.timestamps == [0.0, 4.0, 7.0] and len(out.frame_indices) == 6


def test_video_matches_hf_video_processor_when_available():
    try:
        from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
    except Exception:  # torchvision missing (the normal case here)
        pytest.skip("HF's video processor needs torchvision")
    rng = np.random.default_rng(3)
    clip = rng.integers(0, 256, (21, 48, 64, 3), dtype=np.uint8)
    hf = Glm5NextVideoProcessor()(videos=[clip], video_metadata=[{"total_num_frames": 21, "fps": 10.0,
                                                                   "duration": 2.1}],
                                  return_metadata=True, return_tensors="np")
    ours = process_video(list(clip), 10.0)
    assert ours.grid_thw == tuple(int(x) for x in hf["video_grid_thw"][0])
    assert ours.frame_indices == [int(i) for i in hf["video_metadata"][0].frames_indices]
    # torchvision's uint8 bicubic vs PIL's: at most one level apart
    assert np.abs(np.asarray(hf["pixel_values_videos"]) - ours.pixel_values).max() < 1.1 / 255 / 0.26


# ------------------------------------------------------------------------------------------------
# Placeholders
# ------------------------------------------------------------------------------------------------

IDS = {"image_token_id": 900, "video_token_id": 901, "image_start_token_id": 902,
       "image_end_token_id": 903, "video_start_token_id": 904, "video_end_token_id": 905}
SPECIAL = {"<|image|>": 900, "<|video|>": 901, "<|begin_of_image|>": 902, "<|end_of_image|>": 903,
           "<|begin_of_video|>": 904, "<|end_of_video|>": 905}


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def _tokenize(text: str) -> list[int]:
    """Special-token-aware toy tokenizer: specials are one id, other chars their code point."""
    out, i = [], 0
    while i < len(text):
        for s, tid in SPECIAL.items():
            if text.startswith(s, i):
                out.append(tid)
                i += len(s)
                break
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def _img(n: int) -> ProcessedImage:
    return ProcessedImage(np.zeros((4 * n, 1176), np.float32), (1, 2, 2 * n), n)


def test_expand_placeholders_two_images_one_video_matches_hf_string():
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    vid = ProcessedVideo(np.zeros((3 * 8, 1176), np.float32), (3, 2, 4), 6, [0.0, 1.0, 2.5])
    items = [_img(2), vid, _img(3)]
    prompt = ("<|user|>a<|begin_of_image|><|image|><|end_of_image|>b"
              "<|begin_of_video|><|video|><|end_of_video|>c<|begin_of_image|><|image|><|end_of_image|>d")
    got = expand_placeholders(_tokenize(prompt), items, IDS, _encode)

    # HF's string-level expansion, through its own frame formatter
    class _P:
        image_token = "<|image|>"

    frame = functools.partial(Glm5NextProcessor.replace_frame_token_id, _P())
    video_str = "".join(frame(ts, num_image_tokens=2) for ts in vid.timestamps)
    want_str = ("<|user|>a<|begin_of_image|>" + "<|image|>" * 2 + "<|end_of_image|>b"
                "<|begin_of_video|>" + video_str + "<|end_of_video|>c"
                "<|begin_of_image|>" + "<|image|>" * 3 + "<|end_of_image|>d")
    assert got == _tokenize(want_str)
    assert "<|end_of_image|>1.0 seconds<|begin_of_image|>" in want_str
    assert got.count(900) == 2 + 6 + 3 and 901 not in got
    # token ids by their strings work too, as do a ModelConfig's fields
    assert expand_placeholders(_tokenize(prompt), items, SPECIAL, _encode) == got
    from glmrt.config import ModelConfig, TextConfig

    assert token_ids_from_config(ModelConfig(text=TextConfig()))["image_token_id"] == 154854


def test_expand_placeholders_errors():
    one_img = _tokenize("x<|begin_of_image|><|image|><|end_of_image|>")
    with pytest.raises(ValueError, match="1 image and 0 video placeholders but 2"):
        expand_placeholders(one_img, [_img(1), _img(1)], IDS)
    with pytest.raises(ValueError, match="but 0 media"):
        expand_placeholders(one_img, [], IDS)
    vid = ProcessedVideo(np.zeros((4, 1176), np.float32), (1, 2, 2), 1, [0.0])
    with pytest.raises(ValueError, match="is an image"):
        expand_placeholders(one_img, [vid], IDS, _encode)
    one_vid = _tokenize("<|begin_of_video|><|video|><|end_of_video|>")
    with pytest.raises(ValueError, match="needs `encode`"):
        expand_placeholders(one_vid, [vid], IDS)
    with pytest.raises(ValueError, match="not <"):
        expand_placeholders(_tokenize("a<|image|>b"), [_img(1)], IDS)
    assert expand_placeholders(_tokenize("plain"), [], IDS) == _tokenize("plain")


# ------------------------------------------------------------------------------------------------
# Media loading
# ------------------------------------------------------------------------------------------------

def _png_bytes(arr: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def test_load_image_data_url_ok_and_truncated():
    arr = _pattern(40, 30)
    img = load_image(_data_url(_png_bytes(arr), "image/png"))
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), arr)
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        data = _png_bytes(_pattern(200, 150, seed=5), fmt)
        with pytest.raises(MediaError, match="truncated or corrupt"):
            load_image(_data_url(data[: len(data) // 2], mime))
    with pytest.raises(MediaError, match="not in a recognised image format"):
        load_image(_data_url(b"not an image at all", "image/png"))
    with pytest.raises(MediaError, match="invalid base64"):
        load_image("data:image/png;base64,@@@@")
    with pytest.raises(MediaError, match="expected image"):
        load_image(_data_url(_png_bytes(arr), "text/html"))
    with pytest.raises(MediaError, match="byte limit"):
        load_image(_data_url(_png_bytes(arr), "image/png"), max_bytes=100)
    with pytest.raises(MediaError, match="pixel limit"):
        load_image(_data_url(_png_bytes(arr), "image/png"), max_pixels=100)


def test_load_image_exif_orientation():
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    Image.fromarray(_pattern(40, 20)).save(buf, format="JPEG", exif=exif)
    assert load_image(_data_url(buf.getvalue(), "image/jpeg")).size == (20, 40)


def test_load_image_local_paths(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png_bytes(_pattern(8, 8)))
    (allowed / "ok.png").write_bytes(_png_bytes(_pattern(9, 7)))
    os.symlink(secret, allowed / "link.png")
    root = str(allowed)
    assert load_image(str(allowed / "ok.png"), allowed_local_path=root).size == (9, 7)
    assert load_image("ok.png", allowed_local_path=root).size == (9, 7)
    assert load_image(f"file://{allowed}/ok.png", allowed_local_path=root).size == (9, 7)
    for bad in (str(secret), f"{allowed}/../secret.png", str(allowed / "link.png"), f"file://{secret}"):
        with pytest.raises(MediaError, match="outside the allowed directory"):
            load_image(bad, allowed_local_path=root)
    with pytest.raises(MediaError, match="not allowed"):
        load_image(str(allowed / "ok.png"))
    with pytest.raises(MediaError, match="cannot open"):
        load_image(str(allowed / "missing.png"), allowed_local_path=root)
    with pytest.raises(MediaError, match="not a regular file"):
        load_image(str(allowed), allowed_local_path=root)


def test_load_image_remote_policy():
    with pytest.raises(MediaError, match="remote image URLs are not allowed"):
        load_image("https://example.com/cat.png")
    with pytest.raises(MediaError, match="unsupported image URL scheme"):
        load_image("ftp://example.com/cat.png", allow_remote=True)


@pytest.fixture
def http_root(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_load_image_remote_allowed_local_server(http_root):
    root, base = http_root
    arr = _pattern(33, 21)
    (root / "a.png").write_bytes(_png_bytes(arr))
    img = load_image(f"{base}/a.png", allow_remote=True, timeout=5)
    assert np.array_equal(np.asarray(img), arr)
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{base}/missing.png", allow_remote=True, timeout=5)
    with pytest.raises(MediaError, match="byte limit"):
        load_image(f"{base}/a.png", allow_remote=True, timeout=5, max_bytes=64)


def test_load_video_errors(tmp_path):
    with pytest.raises(MediaError, match="not a readable video container"):
        load_video(_data_url(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50, "video/mp4"))
    data = _encode_mp4([np.full((32, 32, 3), i * 8, np.uint8) for i in range(20)], 10)
    with pytest.raises(MediaError):
        load_video(_data_url(data[: len(data) // 2], "video/mp4"))
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(30)]
    webm = _encode_mp4(noise, 10, "webm", "libvpx")
    assert len(load_video(_data_url(webm, "video/webm"))[0]) == 30
    # a streamable container cut short decodes its first part without any FFmpeg error
    with pytest.raises(MediaError, match=r"truncated: decoded \d"):
        decode_video(webm[: len(webm) * 3 // 10])
    with pytest.raises(MediaError, match="expected video"):
        load_video(_data_url(data, "image/png"))
    (tmp_path / "v.mp4").write_bytes(data)
    frames, fps = load_video(str(tmp_path / "v.mp4"), allowed_local_path=str(tmp_path))
    assert len(frames) == 20 and fps == 10.0
    with pytest.raises(MediaError, match="outside the allowed directory"):
        load_video(str(tmp_path / "v.mp4"), allowed_local_path=str(tmp_path / "sub"))
    with pytest.raises(MediaError, match="more than"):
        load_video(_data_url(data, "video/mp4"), max_decoded_bytes=10_000)


# ------------------------------------------------------------------------------------------------
# Process constraints
# ------------------------------------------------------------------------------------------------

def test_vision_package_does_not_import_torch():
    code = ("import sys; import glmrt.vision, glmrt.vision.media, glmrt.vision.processor; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_to_torch():
    torch = pytest.importorskip("torch")
    from glmrt.vision import to_torch

    items = [_img(1), _img(2)]
    pv, grid = to_torch(items, dtype=torch.bfloat16)
    assert pv.shape == (12, 1176) and pv.dtype == torch.bfloat16
    assert grid.tolist() == [[1, 2, 2], [1, 2, 4]]
