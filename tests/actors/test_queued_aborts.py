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

torch.set_num_threads(1)


def _image_url(seed: int) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _capture(actor, monkeypatch) -> list:
    sent: list = []

    async def capture(peer_id, msg, tensors=()):
        sent.append((peer_id, msg))
    monkeypatch.setattr(actor, "send", capture)
    return sent


async def test_the_tokenizer_passes_an_abort_on_to_the_vision_actor(ckpt, tmp_path, monkeypatch):
    from actors.tokenizer import TokenizerActor

    cfg = TokenizerActorConfig(model_path=ckpt, vocab_size=load_model_config(ckpt).text.vocab_size,
                               vision_replicas=1)
    tokenizer = TokenizerActor(run_spec("tokenizer", tmp_path, cfg))
    await tokenizer.setup()
    sent = _capture(tokenizer, monkeypatch)
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
