"""MXFP4 (Quark) and NVFP4 (ModelOpt) checkpoints: codec, writer, strict dequantising loader, CLI.

References here are written out independently of glmrt/checkpoint/fp4.py: a brute-force
nearest-grid-point rounding, explicit nibble/scale expansion in float64, and HF transformers'
own MXFP4 dequantiser (gpt-oss layout) as a cross-check of the byte layout.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends.reference import ReferenceOps
from glmrt.checkpoint import fp4
from glmrt.checkpoint.presets import preset_config
from glmrt.checkpoint.writer import fp4_modules, write_checkpoint
from glmrt.config import ConfigError, ModelConfig, QuantConfig, load_model_config
from glmrt.model.loader import CheckpointError, load_checkpoint
from glmrt.model.session import DirectSession

torch.set_num_threads(1)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
PROMPT = torch.randint(0, 900, (24,), generator=torch.Generator().manual_seed(77)).tolist()
SCHEMES = ("mxfp4", "nvfp4")


# ---- independent references ----------------------------------------------------------------

def ref_code(v: float) -> int:
    """Nearest of the 16 e2m1 values; ties to the even magnitude index; beyond 6 saturates."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - mag), i % 2))
    return best | (8 if v < 0 else 0)


def ref_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes -> float64 values, low nibble first, written out by hand."""
    lo, hi = (packed.long() & 15), (packed.long() >> 4)
    codes = torch.stack([lo, hi], -1).flatten(-2)
    mag = torch.tensor(GRID, dtype=torch.float64)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def ref_dequant(scheme: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    v = ref_values(parts["weight"])
    if scheme == "mxfp4":
        s = torch.pow(2.0, parts["weight_scale"].double() - 127).repeat_interleave(32, dim=-1)
        return (v * s).float()
    s = parts["weight_scale"].double().repeat_interleave(16, dim=-1)
    return (v * s * parts["weight_scale_2"].double()).float()


def logits_of(model, tokens=PROMPT) -> torch.Tensor:
    sess = DirectSession(model, max_requests=1, max_tokens=64)
    rid = sess.new_request()
    return sess.step({rid: tokens})[rid]


def internal(key: str, num_layers: int) -> tuple[str, int | None]:
    key = key.replace("model.language_model.", "model.", 1)
    if key.startswith("model.visual."):
        return key[len("model."):], None
    if key.startswith(f"model.layers.{num_layers}."):
        key = "mtp." + key[len(f"model.layers.{num_layers}."):]
    parts = key.split(".")
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
        i = parts.index("experts")
        return ".".join(parts[: i + 1] + parts[i + 2:]), int(parts[i + 1])
    return key, None


def packed_groups(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint weight name -> {role: tensor} for every uint8 weight."""
    out = {}
    for k, v in tensors.items():
        if k.endswith(".weight") and v.dtype == torch.uint8:
            base = k[: -len(".weight")]
            out[k] = {"weight": v, **{role: tensors[f"{base}.{role}"] for role in
                                      ("weight_scale", "weight_scale_2", "input_scale") if f"{base}.{role}" in tensors}}
    return out


def rewrite(src: Path, dst: Path, edit, config_edit=None) -> Path:
    dst.mkdir()
    for name in ("config.json", "hf_quant_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return preset_config("tiny")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp4")


@pytest.fixture(scope="module")
def ckpt(tiny, root):
    dirs = {}
    for scheme in SCHEMES:
        d = root / scheme
        write_checkpoint(tiny, str(d), seed=11, dtype=scheme, tokenizer=False, progress=False)
        dirs[scheme] = d
    return dirs


@pytest.fixture(scope="module")
def loaded(ckpt):
    return {s: load_checkpoint(ckpt[s], ReferenceOps(), dtype=torch.float32)[0] for s in SCHEMES}


# ---- the codec -------------------------------------------------------------------------------

def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(fp4.unpack_fp4(packed), codes)
    # low nibble = even element
    assert fp4.pack_fp4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert fp4.unpack_fp4(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [3, 10]
    # every code's value
    assert fp4.fp4_values(fp4.pack_fp4(torch.arange(16, dtype=torch.uint8))).tolist() == \
        GRID + [-g for g in GRID]


def test_rounding_is_nearest_even_on_the_grid():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    probes = GRID + mids + [m + d for m in mids for d in (-1e-6, 1e-6)] + [6.5, 7.0, 9.0, 1e30, 0.1, 2.9]
    probes += torch.empty(2000).uniform_(-7, 7, generator=torch.Generator().manual_seed(1)).tolist()
    x = torch.tensor(probes + [-p for p in probes], dtype=torch.float32)
    got = fp4.e2m1_codes(x).tolist()
    want = [ref_code(float(v)) for v in x]
    assert got == want
    # ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    vals = fp4.fp4_values(fp4.pack_fp4(fp4.e2m1_codes(torch.tensor(mids + [6.0], dtype=torch.float32)))).tolist()
    assert vals == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


@pytest.mark.parametrize("amax, exponent", [(1.0, -2), (1.5, -2), (1.74, -2), (1.75, -1), (1.8, -1),
                                            (3.0, -1), (3.5, 0), (6.0, 0), (2.0 ** -20, -22), (0.0, -127)])
def test_mxfp4_scale_is_the_smallest_power_of_two_below_seven(amax, exponent):
    assert fp4.mxfp4_scale_exponents(torch.tensor([amax])).item() == exponent + 127


def _blocks(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    return w * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))  # magnitudes vary by row


@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 96), (1, 32)])
def test_mxfp4_quantise_dequantise(shape):
    w = _blocks(shape, sum(shape))
    w[0, :32] = 0.0  # an all-zero block
    packed, scale = fp4.quantize_mxfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scale.shape == (*shape[:-1], shape[-1] // 32)
    assert packed.dtype == scale.dtype == torch.uint8
    s = torch.pow(2.0, scale.double() - 127)
    amax = w.reshape(*shape[:-1], -1, 32).abs().amax(-1).double()
    nz = amax > 0
    assert (amax[nz] / s[nz] < 7).all() and (amax[nz] / (s[nz] / 2) >= 7).all()
    # dequantised == s * (the grid point nearest to w / s), element by element
    se = s.repeat_interleave(32, dim=-1)
    want = torch.tensor([float(GRID[ref_code(v) & 7]) * (-1 if ref_code(v) >= 8 else 1)
                         for v in (w.double() / se).flatten().tolist()], dtype=torch.float64).reshape(shape) * se
    deq = fp4.dequantize_mxfp4(packed, scale)
    assert torch.equal(deq.double(), want)
    assert ((deq - w).abs().double() <= se).all()  # at most half the widest grid step (2) in scale units
    assert torch.equal(deq, ref_dequant("mxfp4", {"weight": packed, "weight_scale": scale}))
    assert (deq[0, :32] == 0).all()


def test_mxfp4_layout_matches_transformers():
    """HF's gpt-oss MXFP4 dequantiser reads the same bytes (blocks [.., G, 16], scales [.., G])."""
    from transformers.integrations.mxfp4 import FP4_VALUES, _convert_moe_packed_tensors
    assert fp4.e2m1_lut().tolist() == [float(v) for v in FP4_VALUES]
    w = _blocks((48, 128), 5)
    packed, scale = fp4.quantize_mxfp4(w)
    hf = _convert_moe_packed_tensors(packed.reshape(1, 48, 4, 16), scale.reshape(1, 48, 4), dtype=torch.float32)
    assert torch.equal(hf[0].T, fp4.dequantize_mxfp4(packed, scale))


@pytest.mark.parametrize("shape", [(5, 48), (3, 2, 32)])
def test_nvfp4_quantise_dequantise(shape):
    w = _blocks(shape, 3 + sum(shape))
    packed, scale, gs = fp4.quantize_nvfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == torch.uint8
    assert scale.shape == (*shape[:-1], shape[-1] // 16) and scale.dtype == torch.float8_e4m3fn
    assert gs.shape == () and gs.dtype == torch.float32
    assert gs.item() == pytest.approx(w.abs().max().item() / (6 * 448), rel=1e-6)
    blocks = w.reshape(*shape[:-1], -1, 16)
    want_scale = (blocks.abs().amax(-1) / (6 * gs)).to(torch.float8_e4m3fn)
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    se = (scale.double() * gs.double()).repeat_interleave(16, dim=-1)
    want = torch.tensor([float(GRID[ref_code(v) & 7]) * (-1 if ref_code(v) >= 8 else 1)
                         for v in (w.double() / se).flatten().tolist()], dtype=torch.float64).reshape(shape) * se
    deq = fp4.dequantize_nvfp4(packed, scale, gs)
    assert torch.equal(deq, want.float())
    assert ((deq - w).abs().double() <= se * (1 + 1e-6)).all()
    parts = {"weight": packed, "weight_scale": scale, "weight_scale_2": gs}
    assert torch.equal(deq, ref_dequant("nvfp4", parts))


def test_nvfp4_shared_global_scale():
    a, b = _blocks((4, 32), 1), 10 * _blocks((4, 32), 2)
    g = fp4.nvfp4_global_scale(torch.maximum(a.abs().max(), b.abs().max()))
    _, _, ga = fp4.quantize_nvfp4(a, g)
    _, _, gb = fp4.quantize_nvfp4(b, g)
    assert ga.item() == gb.item() == g.item()


# ---- config --------------------------------------------------------------------------------------

def test_quant_configs_parse_and_round_trip():
    q = QuantConfig.from_dict(QuantConfig.mxfp4(("lm_head",)).to_dict())
    assert q == QuantConfig.mxfp4(("lm_head",)) and q.scheme == "mxfp4" and q.group_size == 32 and q.is_fp4
    hf = QuantConfig.from_dict({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    assert hf.scheme == "mxfp4" and hf.ignored == ("lm_head",)
    assert QuantConfig.from_dict(hf.to_dict()) == hf
    n = QuantConfig.from_dict(QuantConfig.nvfp4(("lm_head",)).to_dict())
    assert n == QuantConfig.nvfp4(("lm_head",)) and n.scheme == "nvfp4" and n.group_size == 16
    nested = QuantConfig.from_dict({"quant_method": "modelopt", "producer": {"name": "modelopt"},
                                    "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                     "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}})
    assert nested == n
    assert QuantConfig().scheme == "fp8" and not QuantConfig().is_fp4


@pytest.mark.parametrize("bad", [
    {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int4", "qscheme": "per_group",
                                                                 "group_size": 128}}},
    {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group",
                                                                 "group_size": 16, "scale_format": "e8m0"}}},
    {"quant_method": "modelopt", "quant_algo": "FP8"},
    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
    {"quant_method": "compressed-tensors"},
])
def test_unsupported_fp4_configs_are_refused(bad):
    with pytest.raises(ConfigError, match="quant"):
        ModelConfig.from_dict({"text_config": preset_config("tiny").text.to_dict(), "quantization_config": bad})


# ---- checkpoints -------------------------------------------------------------------------------

def test_checkpoint_format(ckpt, tiny):
    q = json.loads((ckpt["mxfp4"] / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "quark"
    w = q["global_quant_config"]["weight"]
    assert (w["dtype"], w["qscheme"], w["group_size"], w["scale_format"]) == ("fp4", "per_group", 32, "e8m0")
    q = json.loads((ckpt["nvfp4"] / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["group_size"]) == ("modelopt", "NVFP4", 16)
    legacy = json.loads((ckpt["nvfp4"] / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["quant_algo"] == "NVFP4" and legacy["exclude_modules"] == q["ignore"]
    assert not (ckpt["mxfp4"] / "hf_quant_config.json").exists()
    for scheme in SCHEMES:
        cfg = load_model_config(ckpt[scheme])
        tensors = load_file(str(ckpt[scheme] / "model.safetensors"))
        groups = packed_groups(tensors)
        packed_modules = {internal(k, tiny.text.num_hidden_layers)[0][: -len(".weight")] for k in groups}
        assert packed_modules == set(fp4_modules(tiny, scheme))
        assert any(".experts." in k for k in groups) and any("shared_experts" in k for k in groups)
        assert not any("self_attn" in k or "lm_head" in k or k.startswith("model.visual") for k in groups)
        n = fp4.GROUP_SIZE[scheme]
        for k, parts in groups.items():
            w, s = parts["weight"], parts["weight_scale"]
            assert s.shape == (w.shape[0], w.shape[1] * 2 // n), k
            if scheme == "mxfp4":
                assert s.dtype == torch.uint8 and set(parts) == {"weight", "weight_scale"}, k
            else:
                assert s.dtype == torch.float8_e4m3fn and set(parts) == {"weight", "weight_scale", "weight_scale_2",
                                                                         "input_scale"}, k
                assert parts["weight_scale_2"].shape == () and parts["input_scale"].shape == ()
                if k.endswith("gate_proj.weight"):  # fused partners share the global scale
                    up = groups[k.replace("gate_proj", "up_proj")]
                    assert torch.equal(parts["weight_scale_2"], up["weight_scale_2"])
        # everything else is bf16 (fp32-kept parameters fp32), and the ignore list names the
        # unpacked linear layers in checkpoint naming
        for k, v in tensors.items():
            if k not in groups and not k.endswith(("_scale", "_scale_2")):
                assert v.dtype in (torch.bfloat16, torch.float32), k
        for k in ("model.language_model.layers.1.self_attn.q_b_proj", "lm_head",
                  "model.language_model.layers.0.self_attn.f_b_proj", "model.language_model.embed_tokens"):
            assert k in cfg.quantization.ignored
        assert not any(k[: -len(".weight")] in cfg.quantization.ignored for k in groups)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_loaded_weights_equal_the_dequantised_reference(scheme, ckpt, loaded, tiny):
    model = loaded[scheme]
    params = dict(model.named_parameters())
    tensors = load_file(str(ckpt[scheme] / "model.safetensors"))
    groups = packed_groups(tensors)
    companions = {k[: -len(".weight")] + "." + r for k, g in groups.items() for r in g if r != "weight"}
    seen = 0
    for k, v in tensors.items():
        if k in companions:
            continue
        name, expert = internal(k, tiny.text.num_hidden_layers)
        p = params[name].data if expert is None else params[name].data[expert]
        want = ref_dequant(scheme, groups[k]) if k in groups else v.float()
        assert p.dtype == torch.float32 and torch.equal(p, want), k
        seen += 1
    assert seen and len(groups) > 100


@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_match_a_float32_model_of_the_dequantised_weights(scheme, ckpt, loaded, root):
    src = ckpt[scheme]
    d = root / f"{scheme}-dequantised"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["torch_dtype"] = "float32"
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    groups = packed_groups(tensors)
    out = {}
    for k, v in tensors.items():
        if k in groups:
            out[k] = ref_dequant(scheme, groups[k])
        elif not k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            out[k] = v.float()
    save_file(out, str(d / "model.safetensors"))
    ref, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    a, b = logits_of(loaded[scheme]), logits_of(ref)
    assert torch.isfinite(a).all()
    err = (a - b).abs().max().item()
    assert err <= 1e-5 * b.abs().max().item(), err


def test_bfloat16_load_is_the_float32_dequantisation_rounded(ckpt, loaded):
    model, _ = load_checkpoint(ckpt["nvfp4"], ReferenceOps(), dtype=torch.bfloat16, with_vision=False)
    f32 = dict(loaded["nvfp4"].named_parameters())
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16:
            assert torch.equal(p, f32[name].to(torch.bfloat16)), name


def test_scales_in_another_shard(ckpt, loaded, root):
    """A packed weight reads its scales from whichever shard holds them."""
    src, d = ckpt["nvfp4"], root / "nvfp4-sharded"
    d.mkdir()
    for name in ("config.json", "hf_quant_config.json"):
        shutil.copy(src / name, d / name)
    tensors = load_file(str(src / "model.safetensors"))
    scales = {k: v for k, v in tensors.items() if k.endswith(("_scale", "_scale_2", "input_scale"))}
    rest = {k: v for k, v in tensors.items() if k not in scales}
    save_file(rest, str(d / "model-00001-of-00002.safetensors"))
    save_file(scales, str(d / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in rest} | {k: "model-00002-of-00002.safetensors"
                                                                 for k in scales}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    ref = loaded["nvfp4"].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_quantised_attention_layer_loads(ckpt, root):
    """Which layers are packed is read off the checkpoint, not hard-coded to the MLPs."""
    key = "model.language_model.layers.1.self_attn.q_b_proj.weight"
    value = {}

    def edit(t):
        value["w"], value["s"] = fp4.quantize_mxfp4(t[key].float())
        t[key], t[key + "_scale"] = value["w"], value["s"]

    d = rewrite(ckpt["mxfp4"], root / "mxfp4-attn", edit)
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    got = model.model.layers[1].self_attn.q_b_proj.weight
    assert torch.equal(got, ref_dequant("mxfp4", {"weight": value["w"], "weight_scale": value["s"]}))


def test_hf_quant_config_json_alone_is_read(ckpt, loaded, root):
    d = rewrite(ckpt["nvfp4"], root / "nvfp4-legacy", lambda t: None,
                config_edit=lambda c: c.pop("quantization_config"))
    assert load_model_config(d).quantization.scheme == "nvfp4"
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    ref = loaded["nvfp4"].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


# ---- strictness --------------------------------------------------------------------------------

EXPERT = "model.language_model.layers.3.mlp.experts.5.down_proj"
DENSE = "model.language_model.layers.0.mlp.up_proj"
ATTN = "model.language_model.layers.1.self_attn.o_proj"


@pytest.mark.parametrize("scheme, edit, match", [
    ("mxfp4", lambda t: t.pop(EXPERT + ".weight_scale"), "without its weight_scale"),
    ("nvfp4", lambda t: t.pop(DENSE + ".weight_scale_2"), "without its weight_scale_2"),
    ("mxfp4", lambda t: [t.pop(EXPERT + ".weight"), t.pop(EXPERT + ".weight_scale")], r"experts \[5\]"),
    ("mxfp4", lambda t: t.__setitem__(ATTN + ".weight_scale", torch.zeros(64, 2, dtype=torch.uint8)),
     "whose weight is not packed"),
    ("mxfp4", lambda t: t.__setitem__(DENSE + ".input_scale", torch.tensor(1.0)), "unexpected.*input_scale"),
    ("mxfp4", lambda t: t.__setitem__(DENSE + ".weight_scale", t[DENSE + ".weight_scale"][:, :1].clone()),
     "weight_scale: shape"),
    ("mxfp4", lambda t: t.__setitem__(DENSE + ".weight", t[DENSE + ".weight"][:, :16].clone()), "weight: shape"),
    ("mxfp4", lambda t: t[DENSE + ".weight_scale"].fill_(255), "NaN"),
    ("nvfp4", lambda t: t.__setitem__(DENSE + ".weight_scale", t[DENSE + ".weight_scale"].float()),
     "float8_e4m3fn"),
    ("mxfp4", lambda t: t.__setitem__("model.language_model.layers.0.mlp.bogus_proj.weight",
                                      torch.zeros(4, 2, dtype=torch.uint8)), "unexpected.*bogus_proj"),
])
def test_broken_checkpoints_are_named(scheme, edit, match, ckpt, tmp_path):
    d = rewrite(ckpt[scheme], tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(d, ReferenceOps(), dtype=torch.float32)


def test_packed_weight_without_fp4_config_is_refused(ckpt, tmp_path):
    d = rewrite(ckpt["mxfp4"], tmp_path / "c", lambda t: None, config_edit=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="uint8"):
        load_checkpoint(d, ReferenceOps(), dtype=torch.float32)


# ---- the command line ----------------------------------------------------------------------------

def test_make_checkpoint_cli_writes_mxfp4_that_loads(tmp_path, loaded):
    exe = shutil.which("glmrt", path=str(Path(sys.executable).parent)) or shutil.which("glmrt")
    if exe is None:
        pytest.skip("the glmrt console script is not installed")
    d = tmp_path / "mxfp4"
    cmd = [exe, "make-checkpoint", "--preset", "tiny", "--dtype", "mxfp4", "--seed", "11", "--out", str(d)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote tiny (mxfp4" in r.stdout and "checkpoint size (mxfp4)" in r.stdout
    assert (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["quantization_config"]["quant_method"] == "quark"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.language_model.layers.2.mlp.experts.0.gate_proj.weight").get_dtype() == "U8"
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    ref = loaded["mxfp4"].state_dict()  # the same seed through the library: the same weights
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
