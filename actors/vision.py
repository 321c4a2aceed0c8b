"""The vision actor: runs the vision tower apart from the engine (its own process or GPU),
when the topology places one; otherwise the engine runs the tower itself.

Pixel patches arrive from the tokenizer as tensor frames; the embeddings go to the engine
that computes the request's prompt, as tensor frames over the engine's inbox (feature
transport `cpu`), or as CUDA IPC handles when the vision actor and the engine share GPUs
(`cuda_ipc`; `auto` picks it then). Requests queue for one worker while the inbox keeps being
read, so the Abort of a client that left (passed on by the tokenizer) drops a queued request
before the tower runs for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from actors.aborts import AbortableQueue
from actors.base import Actor
from glmrt import protocol as P


class VisionActor(Actor):
    kind = "vision"

    async def setup(self) -> dict[str, Any]:
        import torch

        from glmrt.model.loader import load_vision_tower

        torch.set_num_threads(self.spec.config.torch_threads)
        device = "cuda" if self.spec.gpus and torch.cuda.is_available() else "cpu"
        want = self.spec.config.dtype  # the engine's dtype, so both paths agree
        dtype = getattr(torch, want) if want != "auto" else (torch.bfloat16 if device == "cuda" else torch.float32)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vision")
        loop = asyncio.get_running_loop()
        self.tower = await loop.run_in_executor(
            self._executor, lambda: load_vision_tower(self.spec.config.model_path, dtype=dtype, device=device))
        self.device, self.dtype = device, dtype
        self._queue = AbortableQueue(lambda item: self._encode_and_send(*item), lambda item: item[0].key, self.log)
        self.transport = self.spec.config.feature_transport if device == "cuda" else "cpu"
        return {"device": device, "feature_transport": self.transport}

    def busy(self) -> bool:
        return self._queue.working or bool(self._queue)

    def load(self) -> tuple[float, int, int]:
        return float(len(self._queue) + self._queue.working), int(self._queue.working), len(self._queue)

    def _encode(self, msg: P.VisionRequest, frames: list):
        import torch

        from transport.codec import tensor_from_frame

        pixels = [tensor_from_frame(it.tensor, frames[it.tensor.frame], as_torch=True) for it in msg.items]
        grid = torch.tensor([list(it.grid_thw) for it in msg.items], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.tower(torch.cat(pixels).to(self.device, self.dtype), grid)
        sizes = [it.num_tokens for it in msg.items]
        if self.transport == "cuda_ipc":
            return [t.contiguous() for t in out.split(sizes)]  # stay on the GPU: handles travel
        return [t.float().contiguous().cpu() for t in out.split(sizes)]

    async def handle(self, msg: Any, frames: list) -> None:
        if isinstance(msg, P.VisionRequest):
            self._queue.put((msg, frames))
        elif isinstance(msg, P.Abort):
            self._queue.aborts.note(msg)

    async def background(self) -> None:
        await self._queue.serve()

    async def run_queued(self) -> None:
        """Encode what is queued, in arrival order, skipping what was aborted meanwhile."""
        await self._queue.run_queued()

    async def _encode_and_send(self, msg: P.VisionRequest, frames: list) -> None:
        loop = asyncio.get_running_loop()
        try:
            embeds = await loop.run_in_executor(self._executor, self._encode, msg, frames)
        except Exception as e:  # a bad item fails its request, not the actor
            await self.send(msg.engine, P.VisionResult(key=msg.key, embeddings=[], error=f"vision failed: {e}"))
            return
        if self.transport == "cuda_ipc":
            from transport.cuda_ipc import export_cuda
            await self.send(msg.engine, P.VisionResult(key=msg.key, embeddings=[],
                                                       cuda_ipc=[export_cuda(t) for t in embeds]))
            return
        refs = [P.TensorRef(dtype="float32", shape=list(t.shape), frame=i) for i, t in enumerate(embeds)]
        await self.send(msg.engine, P.VisionResult(key=msg.key, embeddings=refs), embeds)

    async def teardown(self) -> None:
        self._executor.shutdown(wait=False)
