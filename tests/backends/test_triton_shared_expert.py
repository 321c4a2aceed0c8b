"""The shared expert seated as expert E of the routed experts (glmrt.model.moe.SharedExpertSlot):
the router's appended column, the MoE layer against the unfused reference layer, and the whole
model's parameters unchanged by the seating."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402
from glmrt.checkpoint.presets import preset_config  # noqa: E402
from glmrt.model.layers import fuse_weight_groups, materialize  # noqa: E402
from glmrt.model.moe import MoE  # noqa: E402
from tests.backends.conftest import gen as _gen, rel as _rel, tol as _tol  # noqa: E402

REF = ReferenceOps()
REF.fp8_activations = CudaH200Ops.fp8_activations  # fp8 layers: the kernels' numerics (w8a8)


@pytest.mark.parametrize("n", [1, 5])
def test_route_appends_the_shared_expert(device, n):
    from backends.kernels.moe_route import moe_route
    g = _gen("append", n)
    e, d, k = 64, 256, 8
    x = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, d, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(e, generator=g) * 0.01
    ref_w, ref_ids = REF.moe_route(x, w, bias, k, 1, 1, True, 2.5, append_expert=e)
    got_w, got_ids = moe_route(x.to(device), w.to(device), bias.to(device), k, True, 2.5, append_expert=e)
    assert got_ids.shape == (n, k + 1) and got_w.shape == (n, k + 1)
    assert torch.equal(got_ids.cpu(), ref_ids)
    assert (got_ids[:, -1] == e).all() and (got_w[:, -1] == 1.0).all()
    assert _rel(got_w, ref_w) < 1e-5
    # without the column: the plain top-k, unchanged
    plain_w, plain_ids = moe_route(x.to(device), w.to(device), bias.to(device), k, True, 2.5)
    assert torch.equal(plain_ids.cpu(), ref_ids[:, :k]) and _rel(plain_w, ref_w[:, :k]) < 1e-5


def _cfg():
    text = preset_config("tiny").text
    # one expert group, so that the router kernel (n_group 1) runs too
    return dataclasses.replace(text, n_group=1, topk_group=1)


def _layer(ops, cfg, dtype, device, fp8: bool) -> MoE:
    with torch.device("meta"):
        moe = MoE(cfg, ops, dtype)
        if fp8:
            for lin in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj,
                        moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
                lin.to_fp8((16, 16))
    fuse_weight_groups(moe, device)
    return materialize(moe, device).eval()


def _fill(moe: MoE, g: torch.Generator) -> None:
    for name, p in moe.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            v = (torch.randn(p.shape, generator=g) * 100).clamp(-448, 448)
        elif "scale_inv" in name:
            v = torch.rand(p.shape, generator=g) * 1e-3 + 1e-4
        elif "bias" in name:
            v = torch.randn(p.shape, generator=g) * 0.01
        else:
            v = torch.randn(p.shape, generator=g) * 0.1
        p.data.copy_(v.to(p.dtype))


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_moe_layer_with_the_shared_expert_seated(device, dtype, fp8, n):
    """The seated layer (one fused-MoE launch, shared expert as pick k+1) against the reference
    layer (routed experts + the shared MLP added), same weights."""
    cfg = _cfg()
    ref = _layer(REF, cfg, dtype, "cpu", fp8)
    _fill(ref, _gen("fill", dtype, fp8))
    got = _layer(CudaH200Ops(), cfg, dtype, device, fp8)
    assert got.shared_slot is not None and got.shared_slot.fused
    # the shared expert's weights are row E of the stacked tensors (one storage)
    assert (got.shared_experts.gate_proj.weight.data_ptr()
            == got.experts.gate_proj.weight.data_ptr() + cfg.n_routed_experts * got.shared_experts.gate_proj.weight.nbytes)
    sd = ref.state_dict()
    for name, p in got.named_parameters():
        p.data.copy_(sd[name])
    x = torch.randn(n, cfg.hidden_size, generator=_gen("x", n)).to(dtype)
    with torch.no_grad():
        want = ref(x)
        out = got(x.to(device))
    # bf16: the shared term joins the fp32 top-k sum (one rounding) instead of a bf16 add
    assert _rel(out, want) < (1e-5 if dtype == torch.float32 else _tol(dtype))


def test_unseatable_shared_expert_keeps_its_own_path(device):
    """A shared expert in another format than the routed experts (here bf16 next to fp8) is
    not seated: the layer runs routed + shared as before, with the shared gate/up fused."""
    cfg = _cfg()
    with torch.device("meta"):
        moe = MoE(cfg, CudaH200Ops(), torch.bfloat16)
        for lin in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
            lin.to_fp8((16, 16))
    fuse_weight_groups(moe, device)
    materialize(moe, device)
    assert not moe.shared_slot.fused
    assert moe.shared_experts.gate_up.weight is not None  # its gate/up still one GEMV
    _fill(moe, _gen("unseated"))
    with torch.device("meta"):
        ref_fp8 = MoE(cfg, REF, torch.bfloat16)
        for lin in (ref_fp8.experts.gate_proj, ref_fp8.experts.up_proj, ref_fp8.experts.down_proj):
            lin.to_fp8((16, 16))
    materialize(ref_fp8, "cpu")
    sd = moe.state_dict()
    for name, p in ref_fp8.named_parameters():
        p.data.copy_(sd[name].cpu())
    x = torch.randn(3, cfg.hidden_size, generator=_gen("x3")).to(torch.bfloat16)
    with torch.no_grad():
        assert _rel(moe(x.to(device)), ref_fp8(x)) < _tol(torch.bfloat16)


@pytest.mark.parametrize("ckpt_dtype", ["float32", "fp8", "nvfp4"])
def test_model_parameters_unchanged_by_the_seating(tmp_path, ckpt_dtype):
    """Loading a checkpoint with the seating (cuda-h200 ops) fills every parameter under its own
    name, shape and value, as the reference ops' model does: 32-bit, block-scaled fp8 (weights
    and scales seated) and NVFP4 (dequantised on load)."""
    from glmrt.checkpoint.writer import write_checkpoint
    from glmrt.model.loader import load_checkpoint
    write_checkpoint(preset_config("tiny"), str(tmp_path), seed=3, dtype=ckpt_dtype, progress=False)
    dt = torch.float32 if ckpt_dtype == "float32" else torch.bfloat16
    want, _ = load_checkpoint(str(tmp_path), REF, dtype=dt, with_mtp=True, with_vision=False)
    got, _ = load_checkpoint(str(tmp_path), CudaH200Ops(), dtype=dt, with_mtp=True, with_vision=False)
    seated = [m for m in got.modules() if isinstance(m, MoE)]
    assert seated and all(m.shared_slot.fused for m in seated)
    want_p = dict(want.named_parameters())
    got_p = dict(got.named_parameters())
    assert want_p.keys() == got_p.keys()
    for name, p in got_p.items():
        assert p.shape == want_p[name].shape and p.dtype == want_p[name].dtype, name
        assert torch.equal(p.view(torch.uint8), want_p[name].view(torch.uint8)), name
    if ckpt_dtype == "fp8":  # fp8 experts have their scales seated too (the MTP layer stays 16-bit)
        fp8 = [m for m in seated if m.experts.gate_proj.is_fp8]
        assert fp8 and all(len(m.shared_slot.scales) == 3 for m in fp8)
