"""The Abort of a client that left reaches the actors that still hold work for it: the tokenizer
passes it on to the vision actor its images went to, and the vision actor drops a request still
waiting in its queue instead of running the tower for nobody (the engine would drop the result)."""

from __future__ import annotations

import base64
import io
import json
import numpy as np
import torch

from glmrt import protocol as P
from glmrt.actor_config import TokenizerActorConfig, VisionActorConfig
from glmrt.config import load_model_config
from glmrt.serving import openai_api as A
from tests.actors.conftest import run_spec
from tests.serving.openai_cases import USER

torch.set_num_threads(1)


def _image_url(seed: int) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _tokenizer(ckpt, tmp_path, monkeypatch, **cfg):
    from actors.tokenizer import TokenizerActor

    config = TokenizerActorConfig(model_path=ckpt, vocab_size=load_model_config(ckpt).text.vocab_size, **cfg)
    tokenizer = TokenizerActor(run_spec("tokenizer", tmp_path, config))
    await tokenizer.setup()
    return tokenizer, _capture(tokenizer, monkeypatch)


def _capture(actor, monkeypatch) -> list:
    sent: list = []

    async def capture(peer_id, msg, tensors=()):
        sent.append((peer_id, msg))
    monkeypatch.setattr(actor, "send", capture)
    return sent


async def test_the_tokenizer_passes_an_abort_on_to_the_vision_actor(ckpt, tmp_path, monkeypatch):
    tokenizer, sent = await _tokenizer(ckpt, tmp_path, monkeypatch, vision_replicas=1)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _image_url(1)}}, {"type": "text", "text": "what is it"}]}]}
    (tokenize,) = A.to_tokenize_requests(A.parse_chat_request(json.dumps(body), "m"), "chatcmpl-v", "detokenizer/0")
    tokenize.engine = "engine/0"
    await tokenizer.handle(tokenize, [])
    await tokenizer.run_queued()
    assert [(peer, type(m).__name__) for peer, m in sent] == [
        ("detokenizer/0", "DetokenizeRequest"), ("vision/0", "VisionRequest"), ("engine/0", "EngineRequest")]
    sent.clear()
    await tokenizer.handle(P.Abort(key=tokenize.key), [])
    assert [(peer, type(m).__name__) for peer, m in sent] == [("vision/0", "Abort")]
    sent.clear()
    await tokenizer.handle(P.Abort(key=P.RequestKey(rid="chatcmpl-other")), [])  # nothing of it at a vision actor
    assert sent == []


async def test_the_vision_actor_drops_a_queued_request_that_was_aborted(ckpt, tmp_path, monkeypatch):
    from actors.vision import VisionActor

    vision = VisionActor(run_spec("vision", tmp_path, VisionActorConfig(model_path=ckpt)))
    await vision.setup()
    sent = _capture(vision, monkeypatch)
    encoded: list[str] = []

    def encode(msg, frames):
        encoded.append(msg.key.rid)
        return [torch.zeros(it.num_tokens, 4) for it in msg.items]
    monkeypatch.setattr(vision, "_encode", encode)
    item = P.MMItem(kind="image", grid_thw=[1, 2, 2], num_tokens=1)
    for rid in ("a", "b", "c"):
        await vision.handle(P.VisionRequest(key=P.RequestKey(rid=rid), items=[item], engine="engine/0"), [])
    assert vision.busy() and vision.load() == (3.0, 0, 3)
    await vision.handle(P.Abort(key=P.RequestKey(rid="b")), [])
    await vision.run_queued()
    assert encoded == ["a", "c"]
    assert [(peer, m.key.rid) for peer, m in sent] == [("engine/0", "a"), ("engine/0", "c")]
    assert not vision.busy()


async def test_a_request_aborted_while_queued_is_never_tokenized(ckpt, tmp_path, monkeypatch):
    """Requests queue behind the one being tokenized while the inbox is still read: an Abort that
    arrives meanwhile drops its request before any work (nothing reaches a detokenizer or an
    engine); the others are served in arrival order."""
    tokenizer, sent = await _tokenizer(ckpt, tmp_path, monkeypatch)
    reqs = []
    for rid in ("a", "b", "c"):
        req = A.parse_chat_request(json.dumps({"model": "m", "messages": USER}), "m")
        (tokenize,) = A.to_tokenize_requests(req, f"chatcmpl-{rid}", "detokenizer/0")
        tokenize.engine = "engine/0"
        reqs.append(tokenize)
        await tokenizer.handle(tokenize, [])
    assert tokenizer.busy() and tokenizer.load() == (3.0, 0, 3)
    await tokenizer.handle(P.Abort(key=reqs[1].key), [])
    await tokenizer.run_queued()
    assert [(peer, m.key.rid) for peer, m in sent] == [
        ("detokenizer/0", "chatcmpl-a"), ("engine/0", "chatcmpl-a"), ("detokenizer/0", "chatcmpl-c"),
        ("engine/0", "chatcmpl-c")]
    assert not tokenizer.busy()


async def test_a_request_aborted_while_its_media_load_goes_no_further(ckpt, tmp_path, monkeypatch):
    """The images of a chat load off the event loop; an Abort read meanwhile stops the request
    before it is rendered or sent to a vision actor, a detokenizer or an engine."""
    import asyncio
    import threading

    tokenizer, sent = await _tokenizer(ckpt, tmp_path, monkeypatch)
    loading, release = threading.Event(), threading.Event()

    def slow_media(messages):
        loading.set()
        release.wait(10)
        return []
    monkeypatch.setattr(tokenizer, "_media_items", slow_media)
    req = A.parse_chat_request(json.dumps({"model": "m", "messages": USER}), "m")
    (tokenize,) = A.to_tokenize_requests(req, "chatcmpl-media", "detokenizer/0")
    await tokenizer.handle(tokenize, [])
    worker = asyncio.create_task(tokenizer.run_queued())
    while not loading.is_set():
        await asyncio.sleep(0.01)
    await tokenizer.handle(P.Abort(key=tokenize.key), [])
    release.set()
    await asyncio.wait_for(worker, 10)
    assert sent == [] and not tokenizer.busy()
