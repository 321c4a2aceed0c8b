"""Prefill -> decode handoff of one request's state, engine side (transport-agnostic).

A prefill engine (role "prefill") computes the prompt, samples the first token and parks
the request (`Engine.handoffs`) with its pages and live slot intact: `HandoffSource` says what
it hands over. The decode engine's `HandoffSink` reserves room for it: pages for the prompt,
reusing the full pages its own prefix cache already holds for the same tokens (KV only — the
KDA state always comes from the prefill, since it describes this request's exact prompt end),
plus a live slot. The named state components (glmrt.protocol: one struct per kind) are then
moved — between processes by a transfer engine (transport/kv), in one process by
`copy_in_process` — and the sink checks what arrived and activates the request, which
continues by computing its first token. The source then releases its copy into its own prefix
cache as any finished request does.

    component          prefill source (rows)            decode destination (rows)
    MLALatentPages     kv.latent[:, pages >= reused]   kv.latent[:, fill pages]
    IndexerKeyPages    kv.pooled[:, pages >= reused]   kv.pooled[:, fill pages]
    IndexerTail        state.tail_k/g[:, slot]          state.tail_k/g[:, slot]
    KDAConv            state.conv[:, slot]              state.conv[:, slot]
    KDARecurrent       state.recurrent[:, slot]         state.recurrent[:, slot]
    KeptHidden         state.last_hidden[:, slot]       state.last_hidden[:, slot]   (speculating engines)

With speculative decoding the prefill runs the MTP draft layer over the prompt as it computes it;
its rows are the pools' last ordinals, so they travel in the same components.
"""

from __future__ import annotations

from glmrt.engine.handoff.components import (
    HandoffError,
    copy_rows,
    handoff_layout,
    layout_mismatch,
    pool_tensors,
    split_by_rank,
    state_components,
)
from glmrt.engine.handoff.sink import HandoffSink, Reservation
from glmrt.engine.handoff.source import HandoffSource, Parked

__all__ = ["HandoffError", "HandoffSink", "HandoffSource", "Parked", "Reservation", "copy_in_process",
           "copy_rows", "handoff_layout", "layout_mismatch", "pool_tensors", "split_by_rank",
           "state_components"]


def copy_in_process(source: HandoffSource, sink: HandoffSink, rid: str) -> int:
    """Move request `rid`'s components from a prefill engine into the rows a decode engine of
    the same process reserved for it, and let the sink check them. Returns bytes moved."""
    res = sink.reservation(rid)
    copy_rows(pool_tensors(source.engine), source.export(rid, res.reused_tokens),
              pool_tensors(sink.engine), res.components)
    return sink.receive(rid, res.components)
