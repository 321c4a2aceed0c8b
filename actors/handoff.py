"""Prefill/decode handoff between engine actors (the engine side is glmrt.engine.handoff).

    prefill                                   decode
    first token -> detokenizer (index 0)
    HandoffOffer(prompt, first token, layout) ->  layout check, reserve pages + slot
                                              <-  HandoffAccept(ok, reused_tokens)
    KVHandoff(components as tensor frames)    ->  write into the reserved pages/slot, activate
                                              <-  HandoffDone(ok)
    release (state -> prefix cache)               decode continues at output index 1

A refused offer (layout mismatch, no room) or a failed write fails that request cleanly on
both sides (EngineError to the detokenizer; memory freed), never a hang. Every function here
runs in the engine's step thread, so it may touch the Engine.
"""

from __future__ import annotations

import zlib

import torch

from glmrt import protocol as P
from glmrt.engine import handoff

COMPONENT_KINDS = ("mla_latent_pages", "indexer_pages", "indexer_tail", "kda_conv", "kda_recurrent")


def layout_of(engine, model_name: str) -> dict:
    lay = engine.layout
    return {"model": model_name, "dtype": str(engine.dtype).removeprefix("torch."), "kv_dtype": lay.kv_dtype,
            "state_dtype": lay.state_dtype, "tp": 1, "page_size": lay.page_size, "num_dsa": lay.num_dsa,
            "num_indexer": lay.num_indexer, "num_kda": lay.num_kda, "kv_lora_rank": lay.kv_lora_rank,
            "conv_dim": lay.conv_dim}


def layout_mismatch(mine: dict, theirs: dict) -> str | None:
    diffs = [f"{k}: prefill {theirs.get(k)!r} vs decode {mine.get(k)!r}" for k in mine if theirs.get(k) != mine.get(k)]
    return "incompatible prefill/decode pair (" + "; ".join(diffs) + ")" if diffs else None


def pack(engine, engine_rid: str, reused_tokens: int, checksum: bool = True):
    """Prefill side: the typed components from the decode side's first missing page on."""
    pages, slot = handoff.source_pages(engine, engine_rid, reused_tokens)
    kv, st = engine.cache.kv, engine.cache.state
    idx = torch.tensor(pages, dtype=torch.long, device=kv.latent.device)
    tensors = [kv.latent.index_select(1, idx), kv.pooled.index_select(1, idx),
               torch.stack([st.tail_k[:, slot], st.tail_g[:, slot]]), st.conv[:, slot], st.recurrent[:, slot]]
    tensors = [t.contiguous().cpu() for t in tensors]
    comps = []
    for i, (kind, t) in enumerate(zip(COMPONENT_KINDS, tensors)):
        raw = t.view(torch.uint8).numpy() if t.numel() else b""
        comps.append(P.StateComponent(kind=kind, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                      num_bytes=t.numel() * t.element_size(),
                                      checksum=zlib.crc32(raw) if checksum else None,
                                      tensor=P.TensorRef(dtype=str(t.dtype).removeprefix("torch."),
                                                         shape=list(t.shape), frame=i)))
    return comps, tensors


def unpack(engine, res: handoff.Reservation, comps: list[P.StateComponent], frames) -> int:
    """Decode side: write the components into the reserved pages and slot. -> bytes written."""
    from transport.codec import tensor_from_frame

    got = {}
    for c in comps:
        t = tensor_from_frame(c.tensor, frames[c.tensor.frame], as_torch=True)
        if c.checksum is not None and zlib.crc32(t.contiguous().view(torch.uint8).numpy()) != c.checksum:
            raise handoff.HandoffError(f"checksum mismatch in {c.kind}")
        got[c.kind] = t
    kv, st = engine.cache.kv, engine.cache.state
    fill = res.fill_pages(engine.config.page_size)
    if got["mla_latent_pages"].shape[1] != len(fill):
        raise handoff.HandoffError(f"{got['mla_latent_pages'].shape[1]} pages sent for {len(fill)} reserved")
    dev = kv.latent.device
    if fill:
        idx = torch.tensor(fill, dtype=torch.long, device=dev)
        kv.latent.index_copy_(1, idx, got["mla_latent_pages"].to(dev, kv.latent.dtype))
        kv.pooled.index_copy_(1, idx, got["indexer_pages"].to(dev, kv.pooled.dtype))
    tail = got["indexer_tail"].to(dev)
    st.tail_k[:, res.slot] = tail[0].to(st.tail_k.dtype)
    st.tail_g[:, res.slot] = tail[1].to(st.tail_g.dtype)
    st.conv[:, res.slot] = got["kda_conv"].to(dev, st.conv.dtype)
    st.recurrent[:, res.slot] = got["kda_recurrent"].to(dev, st.recurrent.dtype)
    return sum(c.num_bytes for c in comps)


POOL_TENSORS = ("latent", "pooled", "tail_k", "tail_g", "conv", "recurrent")


def pool_tensors(engine) -> dict:
    kv, st = engine.cache.kv, engine.cache.state
    return {"latent": kv.latent, "pooled": kv.pooled, "tail_k": st.tail_k, "tail_g": st.tail_g,
            "conv": st.conv, "recurrent": st.recurrent}


def make_transfer(engine, name: str):
    """A transfer engine (NIXL when it works here) with this engine's pools registered, or
    None: then the state travels in-band as tensor frames (the ZMQ fallback).
    GLMRT_KV_TRANSFER=frames|nixl|zmq|auto chooses (default auto: NIXL, else frames)."""
    from glmrt import env

    prefer = env.kv_transfer()
    if prefer == "frames":
        return None
    try:
        from transport.kv_transfer import make_transfer_engine
        xfer = make_transfer_engine(name, prefer="nixl" if prefer == "auto" else prefer)
        for tid, t in pool_tensors(engine).items():
            xfer.register(tid, t)
        return xfer
    except Exception:  # no NIXL on this machine: fall back to frames
        if prefer not in ("auto",):
            raise
        return None


def regions(engine_or_descs, pages: list[int], slot: int):
    """The regions of one request's state, in a fixed order both sides agree on."""
    from transport.kv_transfer import page_regions, slot_regions

    get = engine_or_descs
    out = []
    for tid in ("latent", "pooled"):
        out += page_regions(get(tid), tid, pages) if pages else []
    for tid in ("tail_k", "tail_g", "conv", "recurrent"):
        out += slot_regions(get(tid), tid, slot)
    return out
