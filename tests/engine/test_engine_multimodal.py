"""Images through the engine: our processor + vision tower + embedding merge against HF's
`generate` with pixel_values on the same checkpoint, and a prefix cache that tells images apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from glmrt.checkpoint.presets import preset_config  # noqa: E402
from glmrt.checkpoint.writer import write_checkpoint  # noqa: E402
from glmrt.engine.config import EngineConfig  # noqa: E402
from glmrt.engine.engine import Engine  # noqa: E402
from glmrt.engine.mm import MMInput  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402
from glmrt.vision import ImageProcessorConfig, process_image  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from bench.hf_reference import import_hf_torch_kda

    import_hf_torch_kda()  # the CPU oracle keeps torch KDA even where fla-core is installed
    from transformers import Glm5NextForConditionalGeneration

    cfg = preset_config("tiny")
    path = str(tmp_path_factory.mktemp("tiny-mm"))
    write_checkpoint(cfg, path, seed=2, dtype="float32")
    hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    engine = Engine(EngineConfig(model=path, page_size=8), log=lambda *a: None)
    return cfg, hf, engine


def image(seed: int, w: int = 40, h: int = 24):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def prompt_with_image(cfg, seed: int, text_len: int = 12):
    pcfg = ImageProcessorConfig.from_vision_config(cfg.vision)
    item = process_image(image(seed), pcfg)
    rng = np.random.default_rng(100 + seed)
    head = rng.integers(1, cfg.text.vocab_size - 60, 5).tolist()
    tail = rng.integers(1, cfg.text.vocab_size - 60, text_len).tolist()
    ids = head + [cfg.image_start_token_id] + [cfg.image_token_id] * item.num_tokens + [cfg.image_end_token_id] + tail
    mm = MMInput("image", torch.from_numpy(item.pixel_values), tuple(item.grid_thw), item.num_tokens)
    return ids, mm, item


def greedy(n=6):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=2)


def run(engine, ids, mm, n=6):
    rid = engine.add_request(ids, greedy(n), mm_items=[mm])[0]
    while engine.has_work():
        engine.step()
    engine.check_invariants()
    return engine.requests.pop(rid)


def test_image_prompt_matches_hf_generate(setup):
    cfg, hf, engine = setup
    ids, mm, item = prompt_with_image(cfg, 0)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(item.pixel_values),
                           image_grid_thw=torch.tensor([list(item.grid_thw)]), max_new_tokens=6,
                           do_sample=False)[0, len(ids):].tolist()
    got = run(engine, ids, mm)
    for i, top in enumerate(got.top_logprobs):
        assert top[0][1] - top[1][1] > 1e-4, f"near-tie at step {i}"
    assert got.output_ids == want


def test_prefix_cache_tells_images_apart(setup):
    cfg, _, engine = setup
    ids_a, mm_a, _ = prompt_with_image(cfg, 1)
    _, mm_b, _ = prompt_with_image(cfg, 2)
    first = run(engine, ids_a, mm_a)
    again = run(engine, ids_a + [7, 8], mm_a)        # same image, longer prompt: hits past the image
    other = run(engine, ids_a + [7, 8], mm_b)        # same ids, different pixels: must not reuse them
    image_at = ids_a.index(cfg.image_token_id)
    assert again.cached_tokens > image_at
    assert other.cached_tokens <= image_at
    fresh = Engine(EngineConfig(model=engine.config.model, page_size=8, disable_radix_cache=True),
                   model=engine.model, log=lambda *a: None)
    assert other.output_ids == run(fresh, ids_a + [7, 8], mm_b).output_ids
    assert first.output_ids


def test_placeholder_count_mismatch_is_refused(setup):
    cfg, _, engine = setup
    ids, mm, _ = prompt_with_image(cfg, 3)
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request(ids[:-20] if ids.count(cfg.image_token_id) > 20 else ids + [cfg.image_token_id],
                           greedy(), mm_items=[mm])


def test_video_prompt_matches_hf_generate(setup):
    from glmrt.checkpoint.tokenizer import build_tokenizer
    from glmrt.vision import expand_placeholders, process_video, token_ids_from_config

    cfg, hf, engine = setup
    rng = np.random.default_rng(9)
    frames = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(8)]
    video = process_video(frames, 4.0, ImageProcessorConfig.from_vision_config(cfg.vision))
    tok = build_tokenizer(cfg.text.vocab_size)
    ids = [11, 12, cfg.video_start_token_id, cfg.video_token_id, cfg.video_end_token_id, 13, 14, 15]
    ids = expand_placeholders(ids, [video], token_ids_from_config(cfg),
                              encode=lambda t: tok.encode(t, add_special_tokens=False).ids)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), pixel_values_videos=torch.from_numpy(video.pixel_values),
                           video_grid_thw=torch.tensor([list(video.grid_thw)]), max_new_tokens=6,
                           do_sample=False)[0, len(ids):].tolist()
    mm = MMInput("video", torch.from_numpy(video.pixel_values), tuple(video.grid_thw), video.num_tokens)
    got = run(engine, ids, mm)
    for i, top in enumerate(got.top_logprobs):
        assert top[0][1] - top[1][1] > 1e-4, f"near-tie at step {i}"
    assert got.output_ids == want
