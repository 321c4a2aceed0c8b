"""Run requests straight through the model, without an engine: for parity tests and benchmarks.

A `DirectSession` owns a small `ModelCache`, gives each request a state slot and a fixed,
deliberately scattered set of KV pages (so page-table indirection is always exercised), and
runs mixed batches: any set of requests, each with any number of new tokens.
"""

from __future__ import annotations

import random

import torch

from backends.meta import BatchMeta, host_to_device
from glmrt.cache.pools import ModelCache


class DirectSession:
    def __init__(self, model, *, max_requests: int = 4, max_tokens: int = 1024, page_size: int | None = None,
                 kv_dtype: str | None = None, state_dtype: str = "float32", shuffle_pages: bool = True,
                 seed: int = 0):
        self.model = model
        text = model.config.text
        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[model.dtype]
        page_size = page_size or max(16, text.index_kpool)
        self.page_size = page_size
        self.pages_per_req = -(-max_tokens // page_size)
        num_pages = self.pages_per_req * max_requests
        with_mtp = model.mtp is not None
        self.cache = ModelCache.allocate(text, num_pages, max_requests, model.device, page_size=page_size,
                                         kv_dtype=kv_dtype or dtype_name, state_dtype=state_dtype,
                                         model_dtype=dtype_name, with_mtp=with_mtp,
                                         tp_size=model.parallel.tp_size)
        order = list(range(num_pages))
        if shuffle_pages:
            random.Random(seed).shuffle(order)
        self._free_pages = order
        self._free_slots = list(range(max_requests))
        self.lens: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self._next = 0

    def new_request(self) -> int:
        if not self._free_slots:
            raise RuntimeError("DirectSession is full")
        rid = self._next
        self._next += 1
        self.slots[rid] = self._free_slots.pop(0)
        self.pages[rid] = [self._free_pages.pop() for _ in range(self.pages_per_req)]
        self.lens[rid] = 0
        return rid

    def release(self, rid: int) -> None:
        self._free_slots.append(self.slots.pop(rid))
        self._free_pages.extend(self.pages.pop(rid))
        self.lens.pop(rid)

    def step(self, chunks: dict[int, list[int] | torch.Tensor], *, all_logits: bool = True,
             input_embeds: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Feed new tokens of several requests in one forward -> logits per request.

        With `all_logits` every new token's logits come back ([n, V]); else only the last ([1, V]).
        """
        rids = list(chunks)
        ids = [torch.as_tensor(chunks[r], dtype=torch.long).flatten() for r in rids]
        seq_lens = [int(x.numel()) for x in ids]
        meta = BatchMeta.build([self.lens[r] for r in rids], seq_lens, [self.slots[r] for r in rids],
                               [self.pages[r] for r in rids], self.page_size, self.model.device)
        flat = torch.cat(ids)
        flat = host_to_device(self.model.device, flat)[0] if flat.device.type == "cpu" else flat.to(self.model.device)
        idx = None
        if not all_logits:
            idx = meta.cu_seqlens_t[1:] - 1  # on the device already: no blocking H2D copy
        logits, _ = self.model(flat, meta, self.cache, input_embeds=input_embeds, logits_indices=idx)
        out, start = {}, 0
        for r, n in zip(rids, seq_lens):
            self.lens[r] += n
            if all_logits:
                out[r] = logits[start:start + n]
                start += n
            else:
                out[r] = logits[start:start + 1]
                start += 1
        return out
