"""A request's named state components (glmrt.protocol) built from an engine's pools, and the
layout both sides of a handoff must share."""

from __future__ import annotations

import math
import os

import torch

from glmrt import protocol as P

PAGE_KINDS = (P.MLALatentPages, P.IndexerKeyPages)
SLOT_KINDS = (P.IndexerTail, P.KDAConv, P.KDARecurrent)
# On an engine of several ranks KDA is split by head: each rank's pools hold their own share of
# these; every other component is replicated, the same bytes on every rank.
PER_RANK_KINDS = (P.KDAConv, P.KDARecurrent)


class HandoffError(RuntimeError):
    """The handoff cannot go on: no room on the decode side, incompatible layouts, or state that
    does not match the reservation."""


def pool_tensors(engine) -> dict[str, torch.Tensor]:
    """The engine's pool tensors by the ids the components name (registered once for transfers).
    A speculating engine's pools also hold the MTP draft layer's rows (the last latent, pooled-key
    and tail ordinals, which travel with their tensors) and hand over the kept hidden state."""
    kv, st = engine.cache.kv, engine.cache.state
    pools = {"latent": kv.latent, "pooled": kv.pooled, "tail_k": st.tail_k, "tail_g": st.tail_g,
             "conv": st.conv, "recurrent": st.recurrent}
    if getattr(engine, "spec_steps", 0):
        pools["last_hidden"] = st.last_hidden
    return pools


def _rows_bytes(pools: dict[str, torch.Tensor], kind: type[P.StateComponent], num_rows: int) -> int:
    """Bytes of `num_rows` rows (axis 1) of every layer of every tensor of `kind`."""
    return sum(t.shape[0] * num_rows * math.prod(t.shape[2:]) * t.element_size()
               for t in (pools[tid] for tid in kind.TENSORS))


def state_components(pools: dict[str, torch.Tensor], pages: list[int], slot: int) -> list[P.AnyStateComponent]:
    """The components of a request's state in `pages` and `slot`, in the order both sides use
    (no page components when every page is already on the decode side)."""
    slot_kinds = SLOT_KINDS + ((P.KeptHidden,) if "last_hidden" in pools else ())
    rows = [(kind, list(pages)) for kind in PAGE_KINDS if pages] + [(kind, [slot]) for kind in slot_kinds]
    return [kind(rows=r, num_bytes=_rows_bytes(pools, kind, len(r))) for kind, r in rows]


def split_by_rank(components: list[P.AnyStateComponent]) -> tuple[list, list]:
    """-> (the replicated components, the per-rank ones), each in order."""
    mine = [c for c in components if isinstance(c, PER_RANK_KINDS)]
    return [c for c in components if not isinstance(c, PER_RANK_KINDS)], mine


def copy_rows(src_pools: dict[str, torch.Tensor], src: list[P.AnyStateComponent],
              dst_pools: dict[str, torch.Tensor], dst: list[P.AnyStateComponent]) -> None:
    """Copy the rows of components `src` into the rows of components `dst` (same kinds, in order)."""
    if [c.kind for c in src] != [c.kind for c in dst]:
        raise HandoffError(f"component kinds differ: {[c.kind for c in src]} vs {[c.kind for c in dst]}")
    for a, b in zip(src, dst):
        if len(a.rows) != len(b.rows):
            raise HandoffError(f"{a.kind}: {len(a.rows)} source rows for {len(b.rows)} destination rows")
        for tid in a.TENSORS:
            s, d = src_pools[tid], dst_pools[tid]
            d[:, b.rows] = s[:, a.rows].to(d.device, d.dtype)


def handoff_layout(engine) -> P.HandoffLayout:
    """This engine's side of the layout check (model name, dtypes, tp, page size, pool shapes)."""
    cfg, lay = engine.config, engine.layout
    return P.HandoffLayout(model=os.path.basename(os.path.normpath(cfg.model or cfg.preset or "")),
                           dtype=str(engine.dtype).removeprefix("torch."), kv_dtype=lay.kv_dtype,
                           state_dtype=lay.state_dtype, tp=engine.parallel.tp_size, page_size=lay.page_size,
                           num_dsa=lay.num_dsa,
                           num_indexer=lay.num_indexer, num_kda=lay.num_kda, kv_lora_rank=lay.kv_lora_rank,
                           conv_dim=lay.conv_dim)


def layout_mismatch(decode: P.HandoffLayout, prefill: P.HandoffLayout) -> str | None:
    """Why a prefill of layout `prefill` cannot hand state to a decode of layout `decode`, or None."""
    diffs = [f"{k}: prefill {getattr(prefill, k)!r} vs decode {getattr(decode, k)!r}"
             for k in decode.__struct_fields__ if getattr(prefill, k) != getattr(decode, k)]
    return "incompatible prefill/decode pair (" + "; ".join(diffs) + ")" if diffs else None
