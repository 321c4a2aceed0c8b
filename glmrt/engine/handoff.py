"""Prefill -> decode handoff of one request's state, engine side (transport-agnostic).

A prefill engine (role "prefill") computes the prompt, samples the first token and parks
the request (`Engine.handoffs`) with its pages and live slot intact. The decode engine
reserves room for it: pages for the prompt, reusing the full pages its own prefix cache
already holds for the same tokens (KV only — the KDA state always comes from the prefill,
since it describes this request's exact prompt end), plus a live slot. The typed state
components are then moved (in-process copies here; NIXL or ZMQ frames between processes,
see transport/kv_transfer.py) and the decode engine activates the request, which continues
by computing its first token. The prefill side then releases its copy into its own prefix
cache as any finished request does.

    component            prefill source                     decode destination
    mla_latent_pages     kv.latent[:, pages >= reused]     kv.latent[:, fill_pages]
    indexer_pages        kv.pooled[:, pages >= reused]     kv.pooled[:, fill_pages]
    indexer_tail         state.tail_k/g[:, slot]            state.tail_k/g[:, slot]
    kda_conv             state.conv[:, slot]                state.conv[:, slot]
    kda_recurrent        state.recurrent[:, slot]           state.recurrent[:, slot]
"""

from __future__ import annotations

from dataclasses import dataclass

from glmrt.cache.slot_manager import LIVE
from glmrt.engine.request import Request, Status
from glmrt.sampling_params import SamplingParams


class HandoffError(RuntimeError):
    """The decode side cannot take the request (no room, incompatible layout)."""


@dataclass
class Reservation:
    rid: str
    prompt_len: int
    reused_tokens: int        # page-aligned prefix already in the decode side's cache
    pages: list[int]          # the request's pages on the decode side, in position order
    slot: int

    def fill_pages(self, page_size: int) -> list[int]:
        return self.pages[self.reused_tokens // page_size:]


def source_pages(engine, rid: str, reused_tokens: int) -> tuple[list[int], int]:
    """The prefill side's pages (from the decode side's first missing page) and slot."""
    req = engine.handoffs[rid]
    ps = engine.config.page_size
    n = -(-req.num_computed // ps)
    return req.pages[reused_tokens // ps:n], req.slot


def reserve(engine, rid: str, prompt_ids: list[int], first_token: int, params: SamplingParams) -> Reservation:
    """Decode side: pages (reusing cached full pages of the same prefix) and a live slot."""
    if rid in engine.requests:
        raise HandoffError(f"request {rid!r} is already on this engine")
    ps = engine.config.page_size
    n_pages = -(-len(prompt_ids) // ps)
    shared, reused = engine.tree.match_pages(prompt_ids, len(prompt_ids))
    need = n_pages - len(shared)
    if not engine.pages.can_allocate(need):
        engine.tree.evict(need_pages=need)
    if engine.slots.num_free == 0:
        engine.tree.evict(need_slots=1)
    if not engine.pages.can_allocate(need) or engine.slots.num_free == 0:
        raise HandoffError(f"no room for request {rid!r}: {need} pages and a slot needed")
    engine.pages.retain(shared)
    pages = shared + engine.pages.allocate(need)
    slot = engine.slots.allocate(LIVE)
    req = Request(rid, list(prompt_ids), params, next(engine._arrival), output_ids=[int(first_token)],
                  status=Status.WAITING, slot=slot, pages=pages, num_computed=0, cached_tokens=reused,
                  admitted_once=True)
    engine.requests[rid] = req
    engine.imports[rid] = req
    return Reservation(rid, len(prompt_ids), reused, list(pages), slot)


def activate(engine, rid: str) -> None:
    """Decode side: the state has arrived; the request decodes from its first token."""
    req = engine.imports.pop(rid)
    req.num_computed = len(req.prompt_ids)
    req.status = Status.RUNNING
    engine.scheduler.running.append(req)
    engine.counters["prompt_tokens"] += len(req.prompt_ids)


def cancel(engine, rid: str) -> None:
    """Decode side: the transfer failed; give the reservation back."""
    req = engine.imports.pop(rid, None)
    if req is not None:
        engine.scheduler.free_request(req)
        req.status = Status.FINISHED
        engine.requests.pop(rid, None)


def release(engine, rid: str) -> None:
    """Prefill side: the decode side has the state; finish the request here (its pages and
    state go to the prefix cache like any finished request's)."""
    req = engine.handoffs.pop(rid)
    req.status = Status.RUNNING
    engine._finish(req, "handoff_done")
    engine.requests.pop(rid, None)


def copy_in_process(src_engine, dst_engine, res: Reservation) -> int:
    """Move the typed components between two engines of one process. Returns bytes moved."""
    ps = src_engine.config.page_size
    if dst_engine.config.page_size != ps:
        raise HandoffError(f"page size differs: prefill {ps}, decode {dst_engine.config.page_size}")
    src_pages, src_slot = source_pages(src_engine, res.rid, res.reused_tokens)
    dst_pages = res.fill_pages(ps)
    if len(src_pages) != len(dst_pages):
        raise HandoffError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    moved = 0
    skv, dkv = src_engine.cache.kv, dst_engine.cache.kv
    for name in ("latent", "pooled"):
        src, dst = getattr(skv, name), getattr(dkv, name)
        if src_pages:
            block = src[:, src_pages]
            dst[:, dst_pages] = block.to(dst.device, dst.dtype)
            moved += block.numel() * block.element_size()
    sst, dst_state = src_engine.cache.state, dst_engine.cache.state
    for name in ("tail_k", "tail_g", "conv", "recurrent"):
        src, dst = getattr(sst, name), getattr(dst_state, name)
        dst[:, res.slot] = src[:, src_slot].to(dst.device, dst.dtype)
        moved += src[:, src_slot].numel() * src.element_size()
    return moved
