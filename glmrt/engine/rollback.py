"""Speculative decoding's rollback from compact inputs, on every rank alike.

A verify forward keeps, for the rows of its drafting requests only, the inputs of every stateful
op: per KDA layer the conv's input and the recurrence's q, k, v, g, beta; per indexer (the
model's and the draft layer's) its keys and gates; and the final hidden states. When a request
keeps n of its k + 1 verified tokens, its slot gets its snapshot back (the state before the
verify) and only those ops run again over the first n kept rows: the conv window, the recurrent
state, both indexer tails and the kept hidden state are then exactly those after the last kept
position, without recomputing projections, attention, MoE or mHC. (Pooled keys of pools the
kept rows complete are rewritten with the values the verify wrote.)
"""

from __future__ import annotations

import torch

from backends.meta import BatchMeta


class Capture:
    """What one verify forward keeps of its drafting requests' rows (`take`, from the layers)."""

    def __init__(self, rows: torch.Tensor | None, lens: list[int]):
        # flat rows of the pass running now (the model's, then the draft layer's); None: every row,
        # kept by reference (the speculative graphs: each op a verify runs reads its inputs only,
        # the decode and short-row kernels, so a kept tensor stays as it was)
        self.rows = rows
        self.offsets = [0]        # captured request j's rows start at offsets[j] of every kept tensor
        for n in lens:
            self.offsets.append(self.offsets[-1] + n)
        self.kept: dict[int, tuple[torch.Tensor, ...]] = {}
        self.hidden: torch.Tensor | None = None

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The captured rows of `t`, copied (an op may later write `t` in place), or `t` itself
        when every row is captured."""
        return t if self.rows is None else t[self.rows]

    def take(self, layer: int, *selected: torch.Tensor) -> None:
        """Keep a layer's op inputs (each already `select`ed)."""
        self.kept[layer] = selected


def roll_back(model, cache, capture: Capture, which: list[int], prefix_lens: list[int], seq_lens: list[int],
              slot_ids: list[int], page_tables: list[list[int]]) -> None:
    """Recompute the state of each request r (captured as `which[r]`, its snapshot already back in
    its slot) over its first `seq_lens[r]` verified rows, from `prefix_lens[r]` on."""
    dev = capture.rows.device
    sel = torch.cat([torch.arange(capture.offsets[j], capture.offsets[j] + n, device=dev)
                     for j, n in zip(which, seq_lens)])
    ps = cache.page_size
    meta = BatchMeta.build(prefix_lens, seq_lens, slot_ids, page_tables, ps, dev)
    draft = BatchMeta.build([p - 1 for p in prefix_lens], seq_lens, slot_ids, page_tables, ps, dev)
    last = torch.tensor([capture.offsets[j] + n - 1 for j, n in zip(which, seq_lens)], device=dev)
    replay(model, cache, capture, sel, meta, draft, last, torch.tensor(slot_ids, device=dev))


def replay(model, cache, capture: Capture, sel: torch.Tensor, meta: BatchMeta, draft_meta: BatchMeta,
           last_rows: torch.Tensor, slots: torch.Tensor) -> None:
    """The stateful ops over the captured rows `sel`, laid out as `meta` says (the draft layer's
    indexer as `draft_meta`, one position back), then each slot's kept hidden state from captured
    row `last_rows[r]`. Reads only device tensors of the metas (the speculative CUDA graphs replay it)."""
    ops, text = model.ops, model.config.text
    ops.begin_forward(int(sel.shape[0]))
    # every kept input's rows at once (on cuda-h200 one launch per eight tensors, not one each)
    order = list(capture.kept)
    rows = iter(ops.gather_rows([t for layer in order for t in capture.kept[layer]], sel))
    kept = {layer: tuple(next(rows) for _ in capture.kept[layer]) for layer in order}
    for layer in model.model.layers:
        att = layer.self_attn
        if layer.layer not in kept:
            continue
        if not layer.is_dsa:
            pre, q, k, v, g, beta = kept[layer.layer]
            ops.causal_conv(pre, cache.conv(layer.layer), att.conv_weight(), meta)
            ops.kda(q, k, v, g, beta, cache.recurrent(layer.layer), meta)
        else:
            k, g = kept[layer.layer]
            ops.indexer_update(k, g, att.indexer.index_kpool_compress_ape, cache.pooled(layer.layer),
                               *cache.tail(layer.layer), meta, text.index_kpool)
    mtp = model.mtp.self_attn.indexer
    k, g = kept[mtp.layer]
    ops.indexer_update(k, g, mtp.index_kpool_compress_ape, cache.pooled(mtp.layer), *cache.tail(mtp.layer),
                       draft_meta, text.index_kpool)
    cache.state.last_hidden[0][slots] = capture.hidden[last_rows].to(cache.state.last_hidden.dtype)
