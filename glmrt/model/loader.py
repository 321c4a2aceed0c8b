"""Build the model and fill it: from a safetensors checkpoint (strict) or with random weights.

The model is built on the `meta` device, switched to FP8 where the checkpoint (or
`--quantization fp8`) asks for it, materialised empty on the target device, and then filled
one checkpoint tensor at a time, so a checkpoint is never held twice in memory.

MXFP4 and NVFP4 checkpoints (recognised from config.json's `quantization_config`; layouts in
glmrt/checkpoint/fp4.py) have no native path in our kernels yet: each packed weight is read
with its scales and dequantised into its model-dtype parameter, one weight at a time. Which
linear layers are packed is read off the checkpoint itself (a uint8 `X.weight` with its
scales), as for FP8, so the ignore list is honoured whatever it names.

Over several ranks (a `Parallel`), each rank builds only its shard of the model and reads only
its part of each checkpoint tensor (`safe_open(...).get_slice`), as the layers' `splits` say
(glmrt.model.layers.param_split); FP8 block scales are cut with their weights, and under
expert parallelism the other ranks' experts are never read.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

from glmrt.checkpoint import fp4
from glmrt.config import ModelConfig, QuantConfig, load_model_config
from glmrt.model.glm5_next import Glm5NextForCausalLM
from glmrt.model.layers import Linear, StackedLinear, forget_derived, fuse_weight_groups, materialize, param_split
from glmrt.model.weights import SKIP, Target, quantize_block_fp8, random_tensor, to_internal
from glmrt.parallel import Parallel, Split

# Linear layers that stay in the model dtype under `--quantization fp8` (and that real FP8
# checkpoints list in their ignore list): embeddings/head, router, indexer weights.
_FP8_KEEP = ("lm_head", "mlp.gate", "indexer.weights_proj", "mtp.")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the missing/unexpected tensors."""


@dataclass
class LoadReport:
    num_tensors: int
    num_bytes: int  # of the checkpoint's files
    skipped: list[str]
    read_bytes: int = 0  # of the tensor data this rank read (its shard and the replicated tensors)


def param_splits(model: torch.nn.Module) -> dict[str, Split | None]:
    """Parameter name -> where it sits in its full checkpoint tensor (None: whole)."""
    modules = dict(model.named_modules())
    out = {}
    for name, _ in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        out[name] = param_split(modules[owner], attr)
    return out


def _fp8_capable(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (Linear, StackedLinear))
            and not n.startswith("visual")}


def build_model(config: ModelConfig, ops, dtype: torch.dtype, device: torch.device | str, *,
                fp8_modules: Iterable[str] = (), fp8_block: tuple[int, int] = (128, 128),
                with_vision: bool = True, with_mtp: bool = True,
                parallel: Parallel | None = None) -> Glm5NextForCausalLM:
    """An uninitialised model on `device` (contents are garbage until loaded or randomised):
    this rank's shard of it when `parallel` spans several ranks."""
    with torch.device("meta"):  # everything, fp8 conversions included: materialize() places meta tensors
        model = Glm5NextForCausalLM(config, ops, dtype, with_vision=with_vision, with_mtp=with_mtp,
                                    parallel=parallel)
        capable = _fp8_capable(model)
        for name in fp8_modules:
            if name not in capable:
                raise CheckpointError(f"FP8 scales given for {name!r}, which is not a linear layer of this model")
            capable[name].to_fp8(fp8_block)
        param_splits(model)  # an FP8 scale block split between ranks is refused here, before allocating
    fuse_weight_groups(model, device)  # the grouped projections' shared tensors, members seated in them
    return materialize(model, device).eval()


def default_fp8_modules(model_config: ModelConfig, dtype: torch.dtype) -> list[str]:
    """The linear layers `--quantization fp8` converts (everything but the keep list)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(model_config, None, dtype)
    # Match whole dotted components: "mlp.gate" (the router) must not catch "mlp.gate_proj".
    return [n for n in _fp8_capable(model) if not any(f".{k.strip('.')}." in f".{n}." for k in _FP8_KEEP)]


def unquantized_linear_modules(model_config: ModelConfig, dtype: torch.dtype) -> list[str]:
    """The linear layers `--quantization fp8` keeps in the model dtype (the checkpoint's ignore list)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(model_config, None, dtype)
    fp8 = set(default_fp8_modules(model_config, dtype))
    return [n for n in _fp8_capable(model) if n not in fp8]


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors files in {path}")
    return [os.path.join(path, x) for x in found]


def _summarise(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" ... and {len(names) - limit} more" if len(names) > limit else "")


# Companion tensors of a packed FP4 weight `X.weight`, by suffix (the order matters: longest first).
_FP4_PARTS = ((".weight_scale_2", "weight_scale_2"), (".weight_scale", "weight_scale"), (".input_scale", "input_scale"))
_NEEDS = {"mxfp4": ("weight", "weight_scale"), "nvfp4": ("weight", "weight_scale", "weight_scale_2")}
_ALLOWED = {"mxfp4": {"weight", "weight_scale"}, "nvfp4": {"weight", "weight_scale", "weight_scale_2", "input_scale"}}


@dataclass
class _Packed:
    """One packed FP4 weight and its companions: role -> (file, key)."""

    target: Target
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)


def _fp4_part(key: str) -> tuple[str, str] | None:
    """`X.weight_scale` -> (`X.weight`, "weight_scale"), etc.; None for other names."""
    for suffix, role in _FP4_PARTS:
        if key.endswith(suffix):
            return key[: -len(suffix)] + ".weight", role
    return None


def _dequantize_packed(scheme: str, group: _Packed, tensors: dict[str, torch.Tensor], shape: tuple[int, ...],
                       dtype: torch.dtype) -> torch.Tensor:
    """Check the packed weight and its scales against the parameter shape, then dequantise."""
    wkey = group.parts["weight"][1]
    n = fp4.GROUP_SIZE[scheme]
    out, inn = shape[:-1], shape[-1]
    if inn % n:
        raise CheckpointError(f"{wkey}: {scheme} needs the input dimension ({inn}) to be a multiple of {n}")
    w, s = tensors["weight"], tensors["weight_scale"]
    want = {"weight": (*out, inn // 2), "weight_scale": (*out, inn // n)}
    for role, t in (("weight", w), ("weight_scale", s)):
        if tuple(t.shape) != want[role]:
            raise CheckpointError(f"{group.parts[role][1]}: shape {tuple(t.shape)} in checkpoint, {want[role]} "
                                  f"expected ({scheme} of a {tuple(shape)} weight)")
    if scheme == "mxfp4":
        if s.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            raise CheckpointError(f"{group.parts['weight_scale'][1]}: {s.dtype}, expected uint8 E8M0 scales")
        if bool((s.view(torch.uint8) == 255).any()):
            raise CheckpointError(f"{group.parts['weight_scale'][1]}: E8M0 scale 255 (NaN)")
        return fp4.dequantize_mxfp4(w, s, dtype)
    if s.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{group.parts['weight_scale'][1]}: {s.dtype}, expected float8_e4m3fn scales")
    for role in ("weight_scale_2", "input_scale"):
        t = tensors.get(role)
        if t is not None and (t.numel() != 1 or not t.is_floating_point()):
            raise CheckpointError(f"{group.parts[role][1]}: expected one float, got {t.dtype} {tuple(t.shape)}")
    return fp4.dequantize_nvfp4(w, s, tensors["weight_scale_2"], dtype)


def _slice_index(ndim: int, split: Split | None, dim: int) -> tuple:
    idx = [slice(None)] * ndim
    if split is not None:
        idx[dim] = slice(split.start, split.start + split.size)
    return tuple(idx)


def _packed_part_slice(role: str, split: Split | None, ndim: int) -> tuple:
    """The index of this rank's rows of a packed FP4 tensor (the weight and its group scales
    share rows; the per-tensor scales are whole); () for the whole tensor."""
    if split is None or split.dim == ndim - 1 or role in ("weight_scale_2", "input_scale"):
        return ()
    return _slice_index(ndim, split, split.dim)


def load_checkpoint(path: str | os.PathLike, ops, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", with_vision: bool = True, with_mtp: bool = True,
                    progress: bool | None = None,
                    parallel: Parallel | None = None) -> tuple[Glm5NextForCausalLM, LoadReport]:
    """Load a HF-format GLM-5.3-Flash checkpoint directory, strictly.

    Every parameter must be filled by the checkpoint and every checkpoint tensor must land
    somewhere (the MTP layer and vision tower may be skipped on request); otherwise
    CheckpointError lists the names. MXFP4 / NVFP4 weights are dequantised to `dtype`. Over
    several ranks each rank builds and reads only its shard (`LoadReport.read_bytes`).
    """
    from safetensors import safe_open

    path = os.fspath(path)
    config = load_model_config(path)
    text = config.text
    scheme = config.quantization.scheme if config.quantization else None
    fp4_scheme = scheme if scheme in fp4.FP4_SCHEMES else None
    files = _checkpoint_files(path)
    plan: list[tuple[str, str, Target]] = []
    packed: dict[tuple[str, int | None], _Packed] = {}
    orphans: list[str] = []  # FP4 scales whose weight is not packed
    unexpected, skipped = [], []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                part = _fp4_part(key) if fp4_scheme else None
                role = part[1] if part else None
                if part is None and fp4_scheme and key.endswith(".weight") and f.get_slice(key).get_dtype() == "U8":
                    part, role = (key, "weight"), "weight"
                tgt = to_internal(part[0] if part else key, text, with_mtp=with_mtp, with_vision=with_vision)
                if tgt is None:
                    unexpected.append(key)
                elif tgt is SKIP:
                    skipped.append(key)
                elif part is None:
                    plan.append((file, key, tgt))
                else:
                    group = packed.setdefault((tgt.param, tgt.expert), _Packed(tgt))
                    if role in group.parts:
                        raise CheckpointError(f"{path}: {key} appears twice ({group.parts[role][0]}, {file})")
                    group.parts[role] = (file, key)
    fp8 = sorted({t.param[: -len(".weight_scale_inv")] for _, _, t in plan if t.param.endswith(".weight_scale_inv")})
    block = config.quantization.weight_block_size if config.quantization else (128, 128)
    model = build_model(config, ops, dtype, device, fp8_modules=fp8, fp8_block=block,
                        with_vision=with_vision, with_mtp=with_mtp, parallel=parallel)
    params = dict(model.named_parameters())
    splits = param_splits(model)
    unexpected += [key for _, key, t in plan if t.param not in params]
    for key, group in list(packed.items()):
        if group.target.param not in params:
            unexpected += [k for _, k in group.parts.values()]
            del packed[key]
        elif "weight" not in group.parts:
            orphans += [k for _, k in group.parts.values()]
        else:
            unexpected += [k for r, (_, k) in group.parts.items() if r not in _ALLOWED[fp4_scheme]]
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) not in this model: "
                              f"{_summarise(unexpected)}")
    if orphans:
        raise CheckpointError(f"{path}: {fp4_scheme} scale tensor(s) whose weight is not packed FP4 (uint8): "
                              f"{_summarise(orphans)}")
    for group in packed.values():
        missing_parts = [r for r in _NEEDS[fp4_scheme] if r not in group.parts]
        if missing_parts:
            raise CheckpointError(f"{path}: packed {fp4_scheme} weight {group.parts['weight'][1]} without its "
                                  f"{', '.join(missing_parts)} tensor(s)")
    filled: dict[str, set] = {n: set() for n in params}
    total_bytes = sum(os.path.getsize(f) for f in files)
    bar = None
    if progress or (progress is None and total_bytes > 2 << 30):
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights")
    # Every file stays open (memory-mapped) so that a packed weight can read its scales from any
    # shard; tensors are still read, converted and copied one at a time.
    work = sorted([(file, key, tgt, None) for file, key, tgt in plan]
                  + [(g.parts["weight"][0], g.parts["weight"][1], g.target, g) for g in packed.values()],
                  key=lambda x: files.index(x[0]))
    read_bytes = 0
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in files}
        for file, key, tgt, group in work:
            dst = params[tgt.param].data
            split = splits[tgt.param]
            expert = tgt.expert
            if expert is not None:  # one expert's [out, in] of a stacked [E, out, in] parameter
                if split is not None and split.dim == 0:  # expert parallelism: this rank's experts only
                    if not split.start <= expert < split.start + split.size:
                        continue
                    expert -= split.start
                    split = None
                elif split is not None:  # each expert's slice of I: the same split, one dim lower
                    split = Split(split.dim - 1, split.start, split.size, split.full)
                dst = dst[expert]
            if group is not None:
                # dequantised where the parameter lives: 4x less to copy, and fast on a GPU
                parts = {}
                for role, (f, k) in group.parts.items():
                    index = _packed_part_slice(role, split, dst.dim())
                    if index:
                        sl = handles[f].get_slice(k)
                        if sl.get_shape()[split.dim] != split.full:  # the full rows, before taking ours
                            raise CheckpointError(f"{k}: {sl.get_shape()[split.dim]} rows in checkpoint, "
                                                  f"{split.full} expected")
                        t = sl[index]
                    else:
                        t = handles[f].get_tensor(k)
                    parts[role] = t.to(dst.device)
                nbytes = sum(t.numel() * t.element_size() for t in parts.values())
                # a split of the input dim (ROW layers) cuts the dequantised rows: FP4 packs two
                # values a byte and shares a scale along it, which a shard need not align with
                cols = split is not None and split.dim == dst.dim() - 1
                shape = split.full_shape(tuple(dst.shape)) if cols else tuple(dst.shape)
                t = _dequantize_packed(fp4_scheme, group, parts, shape, dst.dtype)
                t = split.take(t) if cols else t
                del parts
            else:
                sl = handles[file].get_slice(key)
                if sl.get_dtype() == "U8" and dst.is_floating_point():
                    raise CheckpointError(f"{key}: uint8 (packed FP4?) weight, but config.json's quantization_config "
                                          f"declares no MXFP4/NVFP4 format")
                full = tuple(split.full_shape(tuple(dst.shape)) if split is not None else dst.shape)
                if tuple(sl.get_shape()) != full:
                    raise CheckpointError(f"{key}: shape {tuple(sl.get_shape())} in checkpoint, {full} expected")
                if split is not None:  # this rank's rows or columns only, read from the file
                    t = sl[_slice_index(len(full), split, split.dim)]
                else:
                    t = handles[file].get_tensor(key)
                nbytes = t.numel() * t.element_size()
                if t.is_floating_point() and t.element_size() == 1 and dst.element_size() != 1:
                    raise CheckpointError(f"{key}: {t.dtype} weight without its weight_scale_inv tensor")
            dst.copy_(t.to(device=dst.device))
            filled[tgt.param].add(expert)
            read_bytes += nbytes
            if bar:
                bar.update(nbytes)
    if bar:
        bar.close()
    missing = []
    for name, got in filled.items():
        p = params[name]
        stacked = name.split(".")[-3] == "experts" if name.count(".") >= 3 else False
        if stacked:
            want = set(range(p.shape[0]))
            missing += [f"{name} (experts {sorted(want - got)[:8]}...)"] if want - got else []
        elif not got:
            missing.append(name)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing from the checkpoint: {_summarise(missing)}")
    forget_derived(model)
    return model, LoadReport(len(plan) + sum(len(g.parts) for g in packed.values()), total_bytes, skipped,
                             read_bytes)


def init_random(model: Glm5NextForCausalLM, seed: int = 0) -> Glm5NextForCausalLM:
    """Fill every parameter with `random_tensor` values, in place, on the model's device.

    FP8 layers get random values quantised per block (their scales included). A rank's shard
    gets its part of the full random tensor (made by name, then cut as the loader cuts a
    checkpoint tensor, after quantising): every rank holds a shard of the same model.
    """
    text = model.config.text
    modules = dict(model.named_modules())
    splits = param_splits(model)
    for name, p in model.named_parameters():
        if name.endswith(".weight_scale_inv"):
            continue
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else None
        split = splits[name]
        shape = split.full_shape(tuple(p.shape)) if split is not None else tuple(p.shape)
        value = random_tensor(name, shape, text, seed, device=p.device)
        if isinstance(owner, (Linear, StackedLinear)) and owner.is_fp8:
            q, s = quantize_block_fp8(value, owner.block)
            scale_split = splits[name[: -len("weight")] + "weight_scale_inv"]
            p.data.copy_(split.take(q) if split is not None else q)
            owner.weight_scale_inv.data.copy_(scale_split.take(s) if scale_split is not None else s)
        else:
            p.data.copy_(split.take(value) if split is not None else value)
    forget_derived(model)
    return model


def load_dummy(config: ModelConfig, ops, *, dtype: torch.dtype = torch.bfloat16, device="cpu",
               quantization: str | None = None, seed: int = 0, with_vision: bool = True,
               with_mtp: bool = True, parallel: Parallel | None = None) -> Glm5NextForCausalLM:
    """`--load-format dummy`: random weights built directly in device memory, no files (this
    rank's shard of the same random model on every rank)."""
    fp8: list[str] = []
    block = (128, 128)
    if quantization == "fp8":
        fp8 = default_fp8_modules(config, dtype)
        block = config.quantization.weight_block_size if config.quantization else block
        if config.quantization is None:
            config = ModelConfig(**{**config.__dict__, "quantization": QuantConfig()})
    elif quantization is not None:
        raise ValueError(f"--quantization {quantization!r} is not supported (choose fp8)")
    model = build_model(config, ops, dtype, device, fp8_modules=fp8, fp8_block=block,
                        with_vision=with_vision, with_mtp=with_mtp, parallel=parallel)
    return init_random(model, seed)


def load_vision_tower(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | str = "cpu"):
    """Only the vision tower of a checkpoint (for a separate vision actor), strictly."""
    from safetensors import safe_open

    from glmrt.model.vision import VisionTower

    path = os.fspath(path)
    config = load_model_config(path)
    if config.vision is None:
        raise CheckpointError(f"{path}: the config has no vision_config")
    with torch.device("meta"):
        tower = VisionTower(config.vision).to(dtype)
    tower = tower.to_empty(device=device).eval()
    params = dict(tower.named_parameters())
    filled = set()
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tgt = to_internal(key, config.text, with_mtp=False, with_vision=True)
                if not isinstance(tgt, Target) or not tgt.param.startswith("visual."):
                    continue
                name = tgt.param[len("visual."):]
                if name not in params:
                    raise CheckpointError(f"{path}: unexpected vision tensor {key}")
                t = f.get_tensor(key)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise CheckpointError(f"{key}: shape {tuple(t.shape)} in checkpoint, "
                                          f"{tuple(params[name].shape)} expected")
                params[name].data.copy_(t)
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} vision tensor(s) missing: {_summarise(missing)}")
    return tower
