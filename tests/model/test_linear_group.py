"""LinearGroup: projections of one input fused into one matmul, their parameters row views of it."""

from __future__ import annotations

import pytest
import torch

from backends.reference import ReferenceOps
from glmrt.checkpoint.presets import preset_config
from glmrt.model.layers import FP8, Linear, LinearGroup, forget_derived, join_columns
from glmrt.model.loader import load_dummy

torch.set_num_threads(1)
OPS = ReferenceOps()


def _linears(sizes, d=32, bias=False, fp8=None):
    ms = [Linear(OPS, d, n, bias=bias, dtype=torch.float32) for n in sizes]
    for m in ms:
        if fp8:
            m.to_fp8(fp8)
    return ms


def _fill(ms, g):
    for m in ms:
        if m.is_fp8:
            from glmrt.model.weights import quantize_block_fp8
            q, s = quantize_block_fp8(torch.randn(m.weight.shape, generator=g), m.block)
            m.weight.data.copy_(q)
            m.weight_scale_inv.data.copy_(s)
        else:
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=g))
        if m.bias is not None:
            m.bias.data.copy_(torch.randn(m.bias.shape, generator=g))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_group_equals_the_members(bias):
    g = torch.Generator().manual_seed(0)
    ms = _linears([48, 16, 8], bias=bias)
    group = LinearGroup(*ms)
    assert group.fuse()
    _fill(ms, g)  # written after fusing, through the members' own parameters
    x = torch.randn(5, 32, generator=g)
    outs = group(x)
    for m, y in zip(ms, outs):
        assert torch.allclose(y, m(x), atol=1e-5, rtol=1e-5)
        assert y.untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr()  # one product
    assert ms[1].weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    joined = join_columns(outs[:2])
    assert joined.untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr()  # a view, no copy
    assert torch.equal(joined, torch.cat(outs[:2], -1))
    assert torch.equal(join_columns([outs[1], outs[0]]), torch.cat([outs[1], outs[0]], -1))  # not adjacent: a copy


def test_a_fused_group_trains_every_member():
    """With grad on and the members' parameters requiring it (training), each member gets its
    gradient; under no_grad the group is one product."""
    g = torch.Generator().manual_seed(1)
    ms = _linears([48, 16, 8])
    group = LinearGroup(*ms)
    assert group.fuse()
    _fill(ms, g)
    x = torch.randn(5, 32, generator=g)
    for m in ms:
        m.weight.requires_grad_(True)
    sum(y.square().sum() for y in group(x)).backward()
    for m in ms:
        assert m.weight.grad is not None and torch.allclose(m.weight.grad, 2 * m(x).detach().T @ x, atol=1e-4)
    with torch.no_grad():
        outs = group(x)
    assert outs[1].untyped_storage().data_ptr() == outs[0].untyped_storage().data_ptr()


def test_fp8_groups_fuse_only_on_whole_scale_blocks():
    g = torch.Generator().manual_seed(1)
    ms = _linears([256, 128, 64], d=256, fp8=(128, 128))  # a partial block only at the end
    group = LinearGroup(*ms)
    assert group.fuse() and group.scale_inv.shape == (4, 2)
    _fill(ms, g)
    x = torch.randn(3, 256, generator=g)
    for m, y in zip(ms, group(x)):
        assert torch.allclose(y, m(x), atol=1e-4, rtol=1e-4)
    split = LinearGroup(*_linears([64, 128], d=256, fp8=(128, 128)))  # a block split between members
    assert not split.fuse() and split.weight is None
    mixed = LinearGroup(*_linears([16], bias=True), *_linears([16]))  # a bias on some only
    assert not mixed.fuse()


def test_models_fuse_their_projections_and_match_unfused():
    """load_dummy fuses KDA's and DSA's input projections, DSA's queries with its indexer's, the
    shared experts' gate/up and KDA's conv weights; the logits equal those of the same weights
    with every group unfused."""
    cfg = preset_config("tiny")
    model = load_dummy(cfg, OPS, dtype=torch.float32, device="cpu", with_vision=False, with_mtp=False)
    groups = [grp for m in model.modules() for grp in getattr(m, "weight_groups", ())]
    assert groups and all(grp.weight is not None for grp in groups)
    queries = [m.q_proj for m in model.modules() if getattr(m, "indexer", None) is not None]
    assert queries and all(grp in groups for grp in queries)
    from glmrt.model.session import DirectSession

    def logits():
        s = DirectSession(model, max_requests=1, max_tokens=64, shuffle_pages=False)
        r = s.new_request()
        return s.step({r: torch.arange(10, 40)}, all_logits=True)[r]

    fused = logits()
    saved = [(grp, grp.weight) for grp in groups]
    for grp, _ in saved:
        grp.weight = None  # the members' views still hold the same values: the unfused path
    try:
        unfused = logits()
    finally:
        for grp, w in saved:
            grp.weight = w
    assert torch.allclose(fused, unfused, atol=1e-4, rtol=1e-4)


def test_build_model_seats_members_without_a_second_copy():
    """build_model allocates each group's shared tensor once and materialises everything else:
    no meta tensor is left, and the members are views of the shared weight from the start."""
    from glmrt.model.loader import build_model

    model = build_model(preset_config("tiny"), OPS, torch.float32, "cpu", with_vision=True, with_mtp=True)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    attn = model.model.layers[0].self_attn
    shared = attn.in_proj.weight.untyped_storage().data_ptr()
    for m in attn.in_proj.members:
        assert m.weight.untyped_storage().data_ptr() == shared
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names)) and "model.layers.0.self_attn.q_proj.weight" in names


def test_build_model_places_fp8_weights_on_the_target_device():
    """Every tensor of an fp8 model lands on the device asked for, the converted layers' weights
    and scales included (they are created after the model; the GPU run found them left on the CPU)."""
    from glmrt.model.loader import build_model, default_fp8_modules

    cfg = preset_config("tiny")
    fp8 = default_fp8_modules(cfg, torch.bfloat16)
    model = build_model(cfg, OPS, torch.bfloat16, "meta", fp8_modules=fp8, with_vision=False, with_mtp=False)
    off = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    assert fp8 and not off
    assert any(t.dtype == torch.float8_e4m3fn for t in model.parameters())


def test_fp8_dense_weight_is_dequantised_once_and_follows_reloads():
    """kv_b_proj's dense weight (read by MLA every step) is dequantised once; after an in-place
    write of the weight or its scales (a reload), forget_derived makes the next call dequantise
    again; a model loaded with fp8 weights serves the loaded values, not a copy kept before."""
    from backends.fp8_numerics import dequantize_block_fp8
    lin = Linear(ReferenceOps(), 64, 48, dtype=torch.bfloat16)
    lin.to_fp8((16, 16))
    g = torch.Generator().manual_seed(0)
    lin.weight.data.copy_(torch.randn(48, 64, generator=g).to(FP8))
    lin.weight_scale_inv.data.copy_(torch.rand(3, 4, generator=g) + 0.5)
    first = lin.dense_weight(torch.bfloat16)
    assert lin.dense_weight(torch.bfloat16) is first
    assert torch.equal(first, dequantize_block_fp8(lin.weight, lin.weight_scale_inv, (16, 16), torch.bfloat16))
    lin.weight_scale_inv.data.mul_(2)  # a reload of the scales, in place, as the loaders write
    forget_derived(lin)                 # ... and then drop the kept copies
    again = lin.dense_weight(torch.bfloat16)
    assert again is not first and torch.equal(again, dequantize_block_fp8(lin.weight, lin.weight_scale_inv,
                                                                          (16, 16), torch.bfloat16))
    lin.weight.data.copy_(torch.randn(48, 64, generator=g).to(FP8))
    forget_derived(lin)
    assert not torch.equal(lin.dense_weight(torch.bfloat16), again)
    assert lin.dense_weight(torch.float32).dtype == torch.float32
    # the loaders drop the copies: a dense weight taken before init_random reflects the new weights
    from glmrt.model.loader import init_random
    model = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.bfloat16, quantization="fp8", seed=1)
    kv_b = next(m.kv_b_proj for m in model.modules() if hasattr(m, "kv_b_proj") and m.kv_b_proj.is_fp8)
    before = kv_b.dense_weight(torch.bfloat16).clone()
    init_random(model, seed=2)
    assert not torch.equal(kv_b.dense_weight(torch.bfloat16), before)
