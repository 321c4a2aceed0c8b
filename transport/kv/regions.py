"""Planning a transfer: byte regions of registered pool tensors, and the regions of the named
state components (`glmrt.protocol.StateComponent`) a handoff moves.

The i-th byte of the concatenated local regions lands on the i-th byte of the concatenated
remote regions; `pair_regions` cuts both lists at every boundary and merges neighbours that are
adjacent on *both* sides, so each transfer posts the fewest descriptors possible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glmrt.protocol import StateComponent
from transport.kv.wire import TensorDesc, TransferError


@dataclass(frozen=True, slots=True)
class Region:
    """`num_bytes` bytes at `offset_bytes` of registered tensor `tensor_id`."""

    tensor_id: str
    offset_bytes: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset_bytes + self.num_bytes


def coalesce(regions: Iterable[Region], *, sort: bool = False) -> list[Region]:
    """Merge consecutive regions of the same tensor that touch (a.end == b.offset_bytes).

    Order is kept (it decides which local byte goes to which remote byte), so only neighbours
    in the list merge; `sort=True` sorts by (tensor_id, offset) first, for a set of regions
    whose order does not matter. Empty regions are dropped.
    """
    items = list(regions)
    for r in items:
        if r.num_bytes < 0 or r.offset_bytes < 0:
            raise TransferError(f"negative offset or size in {r}")
    items = [r for r in items if r.num_bytes > 0]
    if sort:
        items.sort(key=lambda r: (r.tensor_id, r.offset_bytes))
    out: list[Region] = []
    for r in items:
        last = out[-1] if out else None
        if last is not None and last.tensor_id == r.tensor_id and last.end == r.offset_bytes:
            out[-1] = Region(r.tensor_id, last.offset_bytes, last.num_bytes + r.num_bytes)
        else:
            out.append(r)
    return out


def pair_regions(local: Sequence[Region], remote: Sequence[Region]) -> tuple[list[Region], list[Region]]:
    """Cut `local` and `remote` at every boundary of either and merge neighbouring pairs that
    are adjacent on both sides: the descriptor lists a transfer posts (same length, pair i has
    equal sizes). Raises TransferError when the two lists do not hold the same number of bytes."""
    lsz, rsz = region_bytes(local), region_bytes(remote)
    if lsz != rsz:
        raise TransferError(f"local regions hold {lsz} bytes but remote regions {rsz}")
    ls = [r for r in local if r.num_bytes > 0]
    rs = [r for r in remote if r.num_bytes > 0]
    out_l: list[Region] = []
    out_r: list[Region] = []
    i = j = lo = ro = 0
    while i < len(ls) and j < len(rs):
        a, b = ls[i], rs[j]
        n = min(a.num_bytes - lo, b.num_bytes - ro)
        sa, sb = Region(a.tensor_id, a.offset_bytes + lo, n), Region(b.tensor_id, b.offset_bytes + ro, n)
        if (out_l and out_l[-1].tensor_id == sa.tensor_id and out_l[-1].end == sa.offset_bytes
                and out_r[-1].tensor_id == sb.tensor_id and out_r[-1].end == sb.offset_bytes):
            pl, pr = out_l[-1], out_r[-1]
            out_l[-1] = Region(pl.tensor_id, pl.offset_bytes, pl.num_bytes + n)
            out_r[-1] = Region(pr.tensor_id, pr.offset_bytes, pr.num_bytes + n)
        else:
            out_l.append(sa)
            out_r.append(sb)
        lo += n
        ro += n
        if lo == a.num_bytes:
            i, lo = i + 1, 0
        if ro == b.num_bytes:
            j, ro = j + 1, 0
    return out_l, out_r


def region_bytes(regions: Iterable[Region]) -> int:
    return sum(r.num_bytes for r in regions)


def _shape_itemsize(tensor: Any) -> tuple[tuple[int, ...], int]:
    """(shape, itemsize) of a contiguous torch tensor or numpy array, or of a TensorDesc."""
    if isinstance(tensor, TensorDesc):
        return tuple(tensor.shape), tensor.num_bytes // max(1, math.prod(tensor.shape))
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_contiguous():
            raise TransferError("pool tensors must be contiguous")
        return tuple(tensor.shape), tensor.element_size()
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise TransferError("pool tensors must be C-contiguous")
        return tuple(tensor.shape), tensor.itemsize
    raise TransferError(f"expected a torch tensor, numpy array or TensorDesc, got {type(tensor).__name__}")


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """(start, count) of runs of consecutive increasing rows, in the given order."""
    out: list[tuple[int, int]] = []
    for p in rows:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def page_regions(tensor: Any, tensor_id: str, pages: Sequence[int]) -> list[Region]:
    """Regions of rows `pages` (axis 1) of every layer (axis 0) of a pool tensor [L, N, ...].

    One region per layer per run of consecutive pages (in the order given: the order pairs
    pages with the peer's pages), coalesced, so a run that spans the tail of one layer and the
    head of the next also becomes one region. `tensor` may be the torch tensor, a numpy array
    or the peer's TensorDesc (from its peer_info), so remote regions are planned the same way.
    """
    shape, itemsize = _shape_itemsize(tensor)
    if len(shape) < 2:
        raise TransferError(f"pool tensor {tensor_id!r} must be [layers, rows, ...], got shape {list(shape)}")
    layers, rows = shape[0], shape[1]
    row_bytes = math.prod(shape[2:]) * itemsize
    pages = [int(p) for p in pages]
    for p in pages:
        if not 0 <= p < rows:
            raise TransferError(f"row {p} is out of range for {tensor_id!r} with {rows} rows")
    layer_bytes = rows * row_bytes
    runs = _runs(pages)
    return coalesce(Region(tensor_id, layer * layer_bytes + start * row_bytes, count * row_bytes)
                    for layer in range(layers) for start, count in runs)


def slot_regions(tensor: Any, tensor_id: str, slot: int | Sequence[int]) -> list[Region]:
    """Regions of state slot(s) `slot` (axis 1) of every layer of a state tensor [L, slots, ...]."""
    return page_regions(tensor, tensor_id, [slot] if isinstance(slot, int) else slot)



def component_regions(components: Iterable[StateComponent], tensor: Callable[[str], Any]) -> list[Region]:
    """The regions of `components`, component by component and tensor by tensor (the order both
    sides of a handoff agree on). `tensor(tensor_id)` gives a pool tensor or a peer's TensorDesc."""
    out: list[Region] = []
    for c in components:
        for tid in c.TENSORS:
            out += page_regions(tensor(tid), tid, c.rows)
    return out


def pair_components(local: Sequence[StateComponent], remote: Sequence[StateComponent]) -> None:
    """Refuse (TransferError) a pairing of two component lists that do not describe the same
    state: the kinds must match in order, with as many rows and as many bytes on each side."""
    kinds = [c.kind for c in local], [c.kind for c in remote]
    if kinds[0] != kinds[1]:
        raise TransferError(f"component kinds differ: local {kinds[0]}, remote {kinds[1]}")
    for a, b in zip(local, remote):
        if len(a.rows) != len(b.rows) or a.num_bytes != b.num_bytes:
            raise TransferError(f"{a.kind}: {len(a.rows)} rows of {a.num_bytes} bytes here, "
                                f"{len(b.rows)} rows of {b.num_bytes} bytes at the peer")
