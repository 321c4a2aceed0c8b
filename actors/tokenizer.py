"""The tokenizer actor: chat template + tokenisation, then the request goes to its engine.

It registers the request with its detokenizer first (stop strings, parsers, prompt ids),
then sends the token ids to the engine the api chose. Bad input becomes a TokenizerError
to the api (an HTTP 400), never a dead actor. No torch in this process.
"""

from __future__ import annotations

import os
from typing import Any

from actors.base import Actor
from glmrt import protocol as P


class TokenizerActor(Actor):
    kind = "tokenizer"

    async def setup(self) -> dict[str, Any]:
        from tokenizers import Tokenizer

        path = os.path.join(self.spec.config["model_path"], "tokenizer.json")
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = int(self.spec.config.get("vocab_size") or self.tok.get_vocab_size())
        self.num = 0
        return {"vocab_size": self.tok.get_vocab_size()}

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.TokenizeRequest):
            await self._tokenize(msg)

    async def _tokenize(self, m: P.TokenizeRequest) -> None:
        from glmrt.serving.chat_template import render_chat

        self.num += 1
        try:
            thinking = True
            if m.kind == "chat":
                kwargs = m.chat_template_kwargs or {}
                thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", True)))
                for msg in m.messages or []:
                    content = msg.get("content")
                    if isinstance(content, list) and any(
                            isinstance(p, dict) and p.get("type") in ("image_url", "video_url", "image", "video")
                            for p in content):
                        raise ValueError("image and video input is not supported by this deployment "
                                         "(no vision actor in this build)")
                text = render_chat(m.messages or [], m.tools, thinking=thinking, reasoning_effort=m.reasoning_effort)
                ids = self.tok.encode(text, add_special_tokens=False).ids
            elif isinstance(m.prompt, str):
                ids = self.tok.encode(m.prompt, add_special_tokens=False).ids
            else:
                ids = [int(t) for t in (m.prompt or [])]
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            if not ids:
                raise ValueError("the prompt is empty after tokenization")
        except ValueError as e:
            await self.send("api/0",
                            P.TokenizerError(rid=m.rid, status=400, message=str(e), code="invalid_request"))
            return
        reasoning = m.kind == "chat" and thinking
        await self.send(m.reply_to, P.DetokenizeRequest(
            rid=m.rid, sampling=m.sampling, prompt_tokens=len(ids), stream=m.stream, reasoning=reasoning,
            tools=m.tools if m.kind == "chat" else None,
            prompt_token_ids=ids if m.return_token_ids else None, engine=m.engine, arrival=m.arrival))
        await self.send(m.engine, P.EngineRequest(rid=m.rid, prompt_ids=ids, sampling=m.sampling,
                                                  detokenizer=m.reply_to, arrival=m.arrival))
