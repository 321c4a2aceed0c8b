"""E2E: images through `glmrt up` and the openai client — data URLs, local paths only under
--allowed-local-media-path, corrupt or refused images answered 400 naming the part, and the
server healthy afterwards."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

pytestmark = pytest.mark.slow


def png_bytes(seed: int, w: int = 40, h: int = 24) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png_bytes(5))
    return d


@pytest.fixture(scope="module")
def dep(start_deployment, media_dir):
    d = start_deployment(["--page-size", "16", "--allowed-local-media-path", str(media_dir),
                          "--limit-mm-per-prompt", '{"image": 2}'], name="multimodal")
    yield d
    d.stop(term_wait=5)


def chat(dep, parts, **kw):
    return dep.client().chat.completions.create(
        model=dep.model_id(), messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


@pytest.mark.timeout(120)
def test_image_data_url_expands_placeholders_and_answers(dep):
    r = chat(dep, [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}])
    assert r.usage.completion_tokens == 4
    ids = r.model_extra["prompt_token_ids"]
    # a 40x24 image at the tiny model's patch 4 / merge 2 becomes 15 merged tokens -> at least 16 (min budget)
    assert len(ids) > 16 + 10
    same = chat(dep, [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}])
    assert same.model_extra["prompt_token_ids"] == ids


@pytest.mark.timeout(120)
def test_local_path_only_under_the_allowed_directory(dep, media_dir):
    r = chat(dep, [{"type": "image_url", "image_url": {"url": str(media_dir / "cat.png")}}])
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        chat(dep, [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}])
    assert "messages[0].content[0]" in str(e.value)


@pytest.mark.timeout(120)
def test_corrupt_and_remote_images_are_400_and_the_server_stays_healthy(dep):
    raw = png_bytes(2)
    for parts, needle in (
        ([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": data_url(raw[: len(raw) // 2])}}],
         "messages[0].content[1]"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!notbase64"}}], "messages[0].content[0]"),
        ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "messages[0].content[0]"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(dep, parts)
        assert needle in str(e.value)
    ok = dep.client().chat.completions.create(model=dep.model_id(), messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.timeout(120)
def test_images_past_the_limit_are_refused_before_any_is_opened(dep):
    """--limit-mm-per-prompt {"image": 2}: three image parts over two messages are a 400 from the
    API, whatever the parts hold (the third is not even an image); two are served."""
    img = {"type": "image_url", "image_url": {"url": data_url(png_bytes(3))}}
    bogus = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}
    with pytest.raises(openai.BadRequestError) as e:
        dep.client().chat.completions.create(
            model=dep.model_id(), max_tokens=2,
            messages=[{"role": "user", "content": [img, img]}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": [bogus, {"type": "text", "text": "and this"}]}])
    assert e.value.body["code"] == "too_many_media_items" and "At most 2 image(s)" in e.value.body["message"]
    assert chat(dep, [img, img, {"type": "text", "text": "both"}]).usage.completion_tokens == 4


@pytest.mark.timeout(120)
def test_video_data_url(dep):
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for i in range(8):
            frame = av.VideoFrame.from_ndarray(np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8),
                                               format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    url = "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()
    r = chat(dep, [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what happens"}])
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 20
    with pytest.raises(openai.BadRequestError) as e:
        chat(dep, [{"type": "video_url", "video_url": {"url": url[: len(url) // 2]}}])
    assert "messages[0].content[0]" in str(e.value)


VISION_TOPOLOGY = """
[engine]
page_size = 16
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "vision"
[[actors]]
kind = "engine"
[[actors]]
kind = "detokenizer"
"""


@pytest.mark.timeout(180)
def test_vision_actor_placement_gives_the_same_tokens(dep, start_deployment, tmp_path_factory):
    """Encoder disaggregation by placement alone: the same request through a separate vision
    actor equals the engine running the tower itself."""
    path = tmp_path_factory.mktemp("vision") / "vision.toml"
    path.write_text(VISION_TOPOLOGY)
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": data_url(png_bytes(4))}}]
    here = chat(dep, parts)
    apart = start_deployment([str(path)], name="vision-actor")
    try:
        assert {a["kind"] for a in apart.actors()} >= {"vision", "engine"}
        there = chat(apart, parts)
        assert there.choices[0].model_extra["token_ids"] == here.choices[0].model_extra["token_ids"]
        assert there.model_extra["prompt_token_ids"] == here.model_extra["prompt_token_ids"]
    finally:
        apart.stop(term_wait=5)
