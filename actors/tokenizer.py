"""The tokenizer actor: chat template + tokenisation, then the request goes to its engine.

It registers the request with its detokenizer first (stop strings, parsers, prompt ids),
then sends the token ids to the engine the api chose, with a copy of that registration (the
engine re-sends it to a detokenizer that restarted). It holds nothing once a request is sent:
the api re-sends a request whose tokenizer died, and the engine drops a second copy. Bad
input, and an explicit max_tokens that does not fit in the context with the prompt, becomes a
TokenizerError to the api (an HTTP 400), never a dead actor. No torch in this process.

Requests wait in a queue that one worker takes in arrival order, while the inbox keeps being
read: an Abort (the client went away) reaches the actor while the request is still queued, or
while its images load, and the request is dropped there instead of being rendered, encoded and
computed for nobody. One that came after its images went to a vision actor is passed on there.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from actors.aborts import AbortableQueue, Recent
from actors.base import Actor
from glmrt import protocol as P
from glmrt.serving.openai_api.errors import max_tokens_beyond_context


class TokenizerActor(Actor):
    kind = "tokenizer"

    async def setup(self) -> dict[str, Any]:
        from tokenizers import Tokenizer

        from glmrt.config import load_model_config

        model_path = self.spec.config.model_path
        self.tok = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.vocab_size = self.spec.config.vocab_size or self.tok.get_vocab_size()
        self.model_config = load_model_config(model_path)
        self.media = self.spec.config.media
        self.num = 0
        self._queue = AbortableQueue(self._tokenize, lambda m: m.key, self.log)
        self._at_vision = Recent()  # request -> the vision actor its images went to: an Abort follows them
        return {"vocab_size": self.tok.get_vocab_size(), "vision": self.model_config.vision is not None}

    def _media_items(self, messages: list[dict]) -> list:
        """Load and preprocess every image/video part, in prompt order. A part that cannot be
        used is a ValueError naming it (an HTTP 400), decided here, before any engine work."""
        from glmrt.vision import ImageProcessorConfig, process_image, process_video
        from glmrt.vision.media import MediaError, load_image, load_video

        items = []
        for i, msg in enumerate(messages):
            content = msg.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("image_url", "image", "video_url", "video"):
                    continue
                where = f"messages[{i}].content[{j}]"
                if self.model_config.vision is None:
                    raise ValueError(f"{where}: this model has no vision tower; image and video input is refused")
                ref = part.get(kind) if kind in ("image_url", "video_url") else part.get(kind) or part.get("url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise ValueError(f"{where}: missing the {kind} url")
                opts = dict(allowed_local_path=self.media.allowed_local_media_path,
                            allow_remote=self.media.allow_remote_media)
                cfg = ImageProcessorConfig.from_vision_config(self.model_config.vision)
                try:
                    if kind.startswith("image"):
                        items.append(process_image(load_image(url, **opts), cfg))
                    else:
                        frames, fps = load_video(url, **opts)
                        items.append(process_video(frames, fps, cfg))
                except MediaError as e:
                    raise ValueError(f"{where}: {e}") from None
        return items

    def busy(self) -> bool:
        return self._queue.working or bool(self._queue)

    def load(self) -> tuple[float, int, int]:
        return float(len(self._queue) + self._queue.working), int(self._queue.working), len(self._queue)

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.TokenizeRequest):
            self._queue.put(msg)
        elif isinstance(msg, P.Abort) and self._queue.aborts.note(msg):
            vision = self._at_vision.pop(msg.key.request)
            if vision is not None:
                await self.send(vision, msg)

    async def background(self) -> None:
        await self._queue.serve()

    async def run_queued(self) -> None:
        """Tokenize what is queued, in arrival order, skipping what was aborted meanwhile."""
        await self._queue.run_queued()

    async def _tokenize(self, m: P.TokenizeRequest) -> None:
        from glmrt.serving.chat_template import render_chat
        from glmrt.serving.openai_api.chat_messages import thinking_on

        self.num += 1
        try:
            thinking = True
            if m.kind == "chat":
                thinking = thinking_on(m.chat_template_kwargs or {})
                # decoding images/video is CPU work: keep it off the event loop
                media = await asyncio.get_running_loop().run_in_executor(None, self._media_items, m.messages or [])
                if m.key in self._queue.aborts:  # gone while its images loaded: no vision or engine work
                    return
                text = render_chat(m.messages or [], m.tools, thinking=thinking, reasoning_effort=m.reasoning_effort)
                ids = self.tok.encode(text, add_special_tokens=False).ids
                if media:
                    from glmrt.vision import expand_placeholders, token_ids_from_config
                    ids = expand_placeholders(ids, media, token_ids_from_config(self.model_config),
                                              encode=lambda t: self.tok.encode(t, add_special_tokens=False).ids)
            elif isinstance(m.prompt, str):
                ids = self.tok.encode(m.prompt, add_special_tokens=False).ids
            else:
                ids = [int(t) for t in (m.prompt or [])]
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            if not ids:
                raise ValueError("the prompt is empty after tokenization")
            if m.kind != "chat":
                media = []
        except (ValueError, OSError, RecursionError) as e:   # the request's own content
            await self.send("api/0",
                            P.TokenizerError(key=m.key, status=400, message=str(e) or type(e).__name__,
                                             code="invalid_request"))
            return
        except Exception as e:   # answered all the same: a request nobody answers waits forever
            self.log.exception("tokenizing %s failed", m.key.rid)
            await self.send("api/0", P.TokenizerError(key=m.key, status=500, message=f"internal error: "
                                                      f"{type(e).__name__}", code="internal_error"))
            return
        if m.max_model_len is not None and len(ids) + m.sampling.max_tokens > m.max_model_len:
            message = max_tokens_beyond_context(len(ids), m.sampling.max_tokens, m.max_model_len, m.kind)
            await self.send("api/0", P.TokenizerError(key=m.key, status=400, message=message,
                                                      code="context_length_exceeded"))
            return
        reasoning = m.kind == "chat" and thinking
        detokenize = P.DetokenizeRequest(
            key=m.key, sampling=m.sampling, prompt_tokens=len(ids), stream=m.stream, reasoning=reasoning,
            tools=m.tools if m.kind == "chat" else None,
            prompt_token_ids=ids if m.return_token_ids else None,
            engine=m.decode or m.engine,  # where a stop string's Abort must go (decode holds it after the first token)
            arrival=m.arrival)
        await self.send(m.reply_to, detokenize)
        mm_items, tensors = [], []
        for k, it in enumerate(media):
            kind = "video" if hasattr(it, "timestamps") else "image"
            mm_items.append(P.MMItem(kind=kind, grid_thw=[int(x) for x in it.grid_thw], num_tokens=it.num_tokens,
                                     tensor=P.TensorRef(dtype="float32", shape=list(it.pixel_values.shape), frame=k)))
            tensors.append(it.pixel_values)
        visions = self.spec.config.vision_replicas
        if mm_items and visions:
            # a vision actor runs the tower; the engine waits for its embeddings
            target = f"vision/{self.num % visions}"
            await self.send(target, P.VisionRequest(key=m.key, items=mm_items, engine=m.engine,
                                                    detokenizer=m.reply_to), tensors)
            self._at_vision.put(m.key.request, target)
            mm_items = [P.MMItem(kind=x.kind, grid_thw=x.grid_thw, num_tokens=x.num_tokens) for x in mm_items]
            tensors = []
        await self.send(m.engine, P.EngineRequest(key=m.key, prompt_ids=ids, sampling=m.sampling,
                                                  detokenizer=m.reply_to, mm_items=mm_items, decode=m.decode,
                                                  arrival=m.arrival, detokenize=detokenize, grammar=m.grammar),
                        tensors)
