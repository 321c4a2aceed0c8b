"""Tensor and expert parallelism: which share of the model this process holds, and the
collectives between the ranks of one engine.

One engine on N GPUs is N processes, one per rank, in one torch.distributed group (NCCL on
CUDA, RCCL on ROCm, gloo on the CPU). A `Parallel` names this process's rank and the group's
sizes; the model's layers and the loader read it to build and load only their own shard, and
the layers that must combine partial results call its collectives. `Parallel.single()` (TP 1,
EP 1, no group) is what a one-GPU engine uses: every collective is then the identity, so the
single-GPU path has no branch and pays nothing.

Collectives go through torch.distributed alone. The torch in the GPU image (2.11) and the one
here (2.13) spell the flat-tensor gather/scatter differently (`*_into_tensor`/`*_tensor` vs
`*_single`); `all_gather` and `reduce_scatter` below pick whichever exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """Which part of a full (checkpoint-shaped) tensor this rank holds: indices
    [start, start + size) of dim `dim`, whose full extent is `full`. A layer records one per
    sharded parameter (glmrt.model.layers `splits`); the loader and the random initialiser cut
    the full tensor by it, so the model is defined once and sharded by this property alone."""

    dim: int
    start: int
    size: int
    full: int

    @property
    def whole(self) -> bool:
        """The whole tensor (a group of one rank)."""
        return self.size == self.full

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `t` (a view)."""
        if t.shape[self.dim] != self.full:
            raise ValueError(f"dim {self.dim} of a {tuple(t.shape)} tensor is not the full {self.full}")
        return t.narrow(self.dim, self.start, self.size)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.full if i == self.dim else n for i, n in enumerate(local))

    def scale_split(self, block: int, what: str) -> "Split":
        """The split of an FP8 weight's block scales (one per `block` indices of this dim) that
        goes with this weight split. The rank's rows must start on a block boundary, or lie in
        one block (a small shard that shares its block's scale with its neighbours); else its
        local block index would not be the checkpoint's and the scales would be misread."""
        full_blocks = math.ceil(self.full / block)
        if self.start % block == 0:
            return Split(self.dim, self.start // block, math.ceil(self.size / block), full_blocks)
        if self.start // block == (self.start + self.size - 1) // block:
            return Split(self.dim, self.start // block, 1, full_blocks)
        raise ValueError(f"{what}: this rank's indices [{self.start}, {self.start + self.size}) of dim {self.dim} "
                         f"split a {block}-wide FP8 scale block; choose a tensor-parallel size whose shards "
                         f"are whole blocks")


@dataclass(frozen=True)
class Parallel:
    """This process's place in its engine's group. `ep_size` is 1 (each rank holds every
    expert, split by intermediate size: TP-MoE) or `tp_size` (each rank holds
    n_routed_experts / ep_size whole experts: EP)."""

    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup; None when tp_size == 1

    def __post_init__(self):
        if self.tp_size < 1 or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.tp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size {self.ep_size} must be 1 or tp_size ({self.tp_size})")

    @classmethod
    def single(cls) -> "Parallel":
        return cls()

    @property
    def active(self) -> bool:
        return self.tp_size > 1

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    def shard(self, total: int, what: str, parts: int | None = None) -> tuple[int, int]:
        """-> (start, size) of this rank's equal share of `total` (over `parts` ranks, default
        tp_size); a size that does not divide is a configuration error naming `what`."""
        parts = self.tp_size if parts is None else parts
        index = self.rank if parts == self.tp_size else self.ep_rank
        if total % parts:
            raise ValueError(f"{what} ({total}) is not divisible by {parts} ranks")
        size = total // parts
        return index * size, size

    def split(self, total: int, what: str, dim: int, parts: int | None = None) -> Split:
        """`shard` as a Split of dim `dim` of a tensor whose full extent there is `total`."""
        start, size = self.shard(total, what, parts)
        return Split(dim, start, size, total)

    # ---- collectives (the identity at TP 1) -------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.active:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        if not self.active:
            return x
        dim = dim % x.dim()
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((self.tp_size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, moved, group=self.group)
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks of `x` [tp_size * n, ...], each rank keeping its n rows."""
        if not self.active:
            return x
        x = x.contiguous()
        out = torch.empty((x.shape[0] // self.tp_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, x, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` on every rank, in place (`src` is a rank of this group)."""
        if self.active:
            dist.broadcast(x, group_src=src, group=self.group)
        return x
