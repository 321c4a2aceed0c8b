"""Parameter-holding building blocks shared by every module of the model.

Each block owns its weights under the checkpoint's own names (`weight`, `bias`,
`weight_scale_inv`) and computes through the backend's ops, so the model never branches on
hardware. Weights are created on whatever device is current (`meta` while building, then
materialised by the loader or the random initialiser).

Tensor parallelism is a property of these blocks, not a second model: a block built with a
`Parallel` holds only its rank's part of each sharded parameter and records, in `splits`
(parameter attribute -> glmrt.parallel.Split), where that part sits in the full checkpoint
tensor. The loader and the random initialiser read `splits` (`param_split`) to cut every full
tensor the same way; FP8 block scales follow their weight's split (Split.scale_split).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from glmrt.parallel import Parallel, Split

FP8 = torch.float8_e4m3fn
COLUMN, ROW = "column", "row"  # a Linear's parallel style: output features split, or input features


def param_split(module: nn.Module, attr: str) -> Split | None:
    """Where `module.<attr>` sits in its full tensor (None: replicated, the whole tensor).
    An FP8 weight's `weight_scale_inv` follows the weight's split, by blocks."""
    splits = getattr(module, "splits", None) or {}
    if attr != "weight_scale_inv":
        s = splits.get(attr)
        return None if s is None or s.whole else s
    w = splits.get("weight")
    if w is None or w.whole:
        return None
    lead = module.weight.dim() - 2  # [E, out, in] stacks: dim 0 (experts) is not blocked
    if w.dim < lead:
        return w
    return w.scale_split(module.block[w.dim - lead], f"{type(module).__name__} weight")


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W may be FP8 e4m3 with per-block `weight_scale_inv` (see `to_fp8`).

    `style` shards it over `parallel`'s ranks (in/out_features are then this rank's):
    COLUMN holds a slice of the output features (and of the bias): its output is this rank's
    slice. ROW holds a slice of the input features, reads this rank's slice of the input, and
    its products are partial sums: `reduce` all-reduces them here; else the caller sums this
    output with others of its kind first and all-reduces once (the MoE: routed + shared). A
    ROW bias is whole on every rank and added by rank 0 only, so it is counted once in the sum.
    """

    def __init__(self, ops, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, parallel: Parallel | None = None,
                 style: str | None = None, reduce: bool = True, name: str = "linear"):
        super().__init__()
        self.ops = ops
        self.parallel = parallel or Parallel.single()
        self.style, self.reduce = style, reduce
        self.splits: dict[str, Split] = {}
        if style == COLUMN:
            self.splits["weight"] = self.parallel.split(out_features, f"{name} output features", 0)
            if bias:
                self.splits["bias"] = self.parallel.split(out_features, f"{name} output features", 0)
            out_features = self.splits["weight"].size
        elif style == ROW:
            self.splits["weight"] = self.parallel.split(in_features, f"{name} input features", 1)
            in_features = self.splits["weight"].size
        elif style is not None:
            raise ValueError(f"unknown Linear style {style!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (128, 128)

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Switch storage to FP8 block-scaled (call before weights are materialised)."""
        self.block = tuple(block)
        self.weight = _param(self.out_features, self.in_features, dtype=FP8)
        self.weight_scale_inv = _param(math.ceil(self.out_features / block[0]),
                                       math.ceil(self.in_features / block[1]), dtype=torch.float32)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (dequantised when FP8); for ops that need the matrix itself.

        An FP8 weight is dequantised once and kept: MLA's absorbed attention reads kv_b_proj
        this way every step, where the dequant was ~150 µs of launches (the H200 fp8 decode
        profile). The copy is remade when the weight moves, and dropped by `forget_derived`,
        which the loaders call after writing weights (they write through `.data`, which no
        version counter sees). The first eager step makes it, before any CUDA-graph capture,
        so a graph reads the kept tensor."""
        if self.is_fp8:
            key = (dtype, self.weight.data_ptr(), self.weight_scale_inv.data_ptr())
            kept = self.__dict__.get("_dense")
            if kept is None or kept[0] != key:
                from backends.fp8_numerics import dequantize_block_fp8
                kept = (key, dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype))
                self.__dict__["_dense"] = kept
            return kept[1]
        return self.weight.to(dtype)

    @property
    def partial(self) -> bool:
        """Its output is this rank's partial sum (a ROW layer on more than one rank)."""
        return self.style == ROW and self.parallel.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.partial:
            return self.ops.linear(x, self.weight, self.bias, self.weight_scale_inv, self.block)
        bias = self.bias if self.parallel.rank == 0 else None
        y = self.ops.linear(x, self.weight, bias, self.weight_scale_inv, self.block)
        return self.parallel.all_reduce(y) if self.reduce else y


def forget_derived(model: nn.Module) -> None:
    """Drop what modules keep derived from their weights (Linear.dense_weight's dequantised
    copy): call after writing weights in place."""
    for mod in model.modules():
        mod.__dict__.pop("_dense", None)


def seat_rows(modules, name: str, device: torch.device | str) -> torch.Tensor:
    """One tensor holding the `name` parameters of `modules` stacked along dim 0, each module's
    parameter re-seated as its row block (a view). Values are not carried over."""
    params = [getattr(m, name) for m in modules]
    shared = torch.empty(sum(p.shape[0] for p in params), *params[0].shape[1:], dtype=params[0].dtype,
                         device=device)
    row = 0
    for m, p in zip(modules, params):
        setattr(m, name, nn.Parameter(shared[row:row + p.shape[0]], requires_grad=False))
        row += p.shape[0]
    return shared


class StackedWeights:
    """WeightOnly modules whose weights a step uses concatenated along dim 0: once fused, their
    weights are row views of one tensor, so the concatenation is that tensor (no copy a step)."""

    def __init__(self, *owners: "WeightOnly"):
        self.owners = list(owners)
        self.weight: torch.Tensor | None = None

    def fuse(self, device: torch.device | str | None = None) -> bool:
        if self.weight is not None:
            return True
        w0 = self.owners[0].weight
        dev = torch.device(device) if device is not None else w0.device
        if dev.type == "meta" or any(o.weight.dtype != w0.dtype or o.weight.shape[1:] != w0.shape[1:]
                                     or o.weight.device != w0.device for o in self.owners):
            return False
        self.weight = seat_rows(self.owners, "weight", dev)
        return True

    def joined(self) -> torch.Tensor:
        return self.weight if self.weight is not None else torch.cat([o.weight for o in self.owners], dim=0)


class LinearGroup:
    """Linear layers that read the same input, run as one matmul once `fuse()` has been called.

    The members keep their own checkpoint-named parameters; `fuse()` (after the model is
    materialised, before its weights are written) re-seats them as row views of one shared
    weight (and FP8 scale) tensor, so loading, quantising and counting parameters see them
    unchanged while a decode step launches one GEMV instead of several small ones. Members
    that cannot share (different formats, biases on some only, FP8 scale blocks split between
    two members) leave the group unfused: the members then run one by one, as before.
    Not a Module: the members stay registered only under their own names.
    """

    def __init__(self, *members: Linear):
        self.members = list(members)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.scale_inv: torch.Tensor | None = None
        self.sizes = [m.out_features for m in members]

    def fusable(self) -> bool:
        m0 = self.members[0]
        same = all(m.in_features == m0.in_features and m.weight.dtype == m0.weight.dtype
                   and m.is_fp8 == m0.is_fp8 and m.block == m0.block and (m.bias is None) == (m0.bias is None)
                   and m.weight.device == m0.weight.device
                   for m in self.members)
        # block-scaled members share scale rows only when every block boundary lines up
        aligned = not m0.is_fp8 or all(m.out_features % m0.block[0] == 0 for m in self.members[:-1])
        return len(self.members) > 1 and same and aligned

    def fuse(self, device: torch.device | str | None = None) -> bool:
        """Allocate the shared tensors on `device` (default: the members' device; members still
        on the meta device need one) and seat the members' parameters in them. Their values are
        not carried over: call before the weights are written."""
        if self.weight is not None:
            return True
        m0 = self.members[0]
        dev = torch.device(device) if device is not None else m0.weight.device
        if dev.type == "meta" or not self.fusable():
            return False
        self.weight = seat_rows(self.members, "weight", dev)
        if m0.bias is not None:
            self.bias = seat_rows(self.members, "bias", dev)
        if m0.is_fp8:  # each member's scale rows: ceil(out / block), whole blocks by fusable()
            self.scale_inv = seat_rows(self.members, "weight_scale_inv", dev)
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's output, in order (column views of one product when fused). Training
        (grad on, members' parameters requiring it) runs the members one by one: the shared
        tensor is no Parameter, so a product through it would leave theirs without gradients."""
        if self.weight is None or (torch.is_grad_enabled() and any(
                p is not None and p.requires_grad for m in self.members for p in (m.weight, m.bias))):
            return [m(x) for m in self.members]
        m0 = self.members[0]
        y = m0.ops.linear(x, self.weight, self.bias, self.scale_inv, m0.block)
        return list(y.split(self.sizes, dim=-1))


def join_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, -1) for 2-D tensors; a view, with no copy, when the parts are side-by-side
    column slices of one tensor (a fused LinearGroup's outputs)."""
    p0 = parts[0]
    width = sum(p.shape[-1] for p in parts)
    adjacent = all(p.dim() == 2 and p.stride() == p0.stride() and p.dtype == p0.dtype and p.stride(1) == 1
                   and p.shape[0] == p0.shape[0] for p in parts)
    if adjacent:
        off = p0.storage_offset()
        for p in parts:
            if p.untyped_storage().data_ptr() != p0.untyped_storage().data_ptr() or p.storage_offset() != off:
                adjacent = False
                break
            off += p.shape[-1]
    if adjacent and (p0.shape[0] <= 1 or p0.stride(0) >= width):
        return p0.as_strided((p0.shape[0], width), p0.stride(), p0.storage_offset())
    return torch.cat(parts, dim=-1)


def fuse_weight_groups(model: nn.Module, device: torch.device | str | None = None) -> int:
    """Fuse every group (LinearGroup, StackedWeights) that a module of `model` declares in
    `weight_groups`; -> fused count."""
    fused = 0
    for mod in model.modules():
        for group in getattr(mod, "weight_groups", ()):
            fused += group.fuse(device)
    return fused


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Module.to_empty for the parameters and buffers still on the meta device only: the fused
    groups' members, already seated in their shared tensors, stay where they are (to_empty would
    give each its own tensor, and allocating them first would hold both copies at once)."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:  # a tensor registered twice stays one tensor
                    new = torch.empty_like(t, device=device)
                    done[id(t)] = nn.Parameter(new, requires_grad=False) if wrap else new
                table[name] = done[id(t)]
    return model


class StackedLinear(nn.Module):
    """E expert matrices stored as one [E, out, in] tensor (FP8-capable like Linear).
    `split` (of the full [E, out, in] tensor: dim 0 = experts, 1 = out, 2 = in) shards it."""

    def __init__(self, num: int, in_features: int, out_features: int, *, dtype: torch.dtype = torch.bfloat16,
                 split: Split | None = None):
        super().__init__()
        self.splits: dict[str, Split] = {}
        if split is not None:
            self.splits["weight"] = split
            num, out_features, in_features = (split.size if split.dim == i else n
                                              for i, n in enumerate((num, out_features, in_features)))
        self.num, self.in_features, self.out_features = num, in_features, out_features
        self.weight = _param(num, out_features, in_features, dtype=dtype)
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (128, 128)

    def to_fp8(self, block: tuple[int, int]) -> None:
        self.block = tuple(block)
        self.weight = _param(self.num, self.out_features, self.in_features, dtype=FP8)
        self.weight_scale_inv = _param(self.num, math.ceil(self.out_features / block[0]),
                                       math.ceil(self.in_features / block[1]), dtype=torch.float32)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale_inv is not None


class RMSNorm(nn.Module):
    def __init__(self, ops, dim: int, eps: float, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, ops, dim: int, eps: float, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = _param(dim, dtype=dtype)
        self.bias = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class WeightOnly(nn.Module):
    """A module that only carries `weight` (conv kernels, embeddings), named as in checkpoints;
    `split` (of the full `shape`) shards it."""

    def __init__(self, *shape: int, dtype: torch.dtype, split: Split | None = None):
        super().__init__()
        self.splits: dict[str, Split] = {}
        if split is not None:
            self.splits["weight"] = split
            shape = tuple(split.size if i == split.dim else n for i, n in enumerate(shape))
        self.weight = _param(*shape, dtype=dtype)


class SwiGLUMLP(nn.Module):
    """Dense or shared-expert MLP: down(silu(clamp(gate)) * clamp(up)); over several ranks
    split by intermediate size (gate/up COLUMN, down ROW). `reduce=False` leaves down's
    partial sums to the caller (the MoE sums the shared expert with the routed ones first)."""

    def __init__(self, ops, hidden: int, inter: int, limit: float | None, *, dtype: torch.dtype,
                 parallel: Parallel | None = None, reduce: bool = True):
        super().__init__()
        self.ops, self.limit = ops, limit
        col = dict(dtype=dtype, parallel=parallel, style=COLUMN, name="MLP intermediate_size")
        self.gate_proj = Linear(ops, hidden, inter, **col)
        self.up_proj = Linear(ops, hidden, inter, **col)
        self.down_proj = Linear(ops, inter, hidden, dtype=dtype, parallel=parallel, style=ROW, reduce=reduce,
                                name="MLP intermediate_size")
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)
        self.weight_groups = (self.gate_up,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(self.ops.swiglu(gate, up, self.limit))
