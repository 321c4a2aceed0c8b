"""Checkpoint loading (layouts, shards, strictness, MTP/vision, FP8) and random-weight models, on `tiny`."""

import json
import math
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends.reference import ReferenceOps
from glmrt.checkpoint.presets import preset_config
from glmrt.checkpoint.writer import write_checkpoint
from glmrt.model.layers import Linear, StackedLinear
from glmrt.model.loader import CheckpointError, load_checkpoint, load_dummy
from glmrt.model.session import DirectSession
from glmrt.model.weights import quantize_block_fp8

torch.set_num_threads(1)

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROMPT = torch.randint(0, 900, (40,), generator=torch.Generator().manual_seed(1234)).tolist()


# ---- helpers ---------------------------------------------------------------------------------

def internal_name(key: str, num_layers: int) -> tuple[str, int | None]:
    """Checkpoint key (nested or flat) -> (our parameter name, expert row), written out independently."""
    key = re.sub(r"^model\.language_model\.", "model.", key)
    key = re.sub(r"^model\.visual\.", "visual.", key)
    key = re.sub(rf"^model\.layers\.{num_layers}\.", "mtp.", key)
    m = re.match(r"^(.*\.experts)\.(\d+)\.(.*)$", key)
    if m:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return key, None


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (FP8, torch.float8_e5m2):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def assert_same_state(m1, m2):
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    diff = [k for k in s1 if not same(s1[k], s2[k])]
    assert not diff, f"parameters differ: {diff[:10]}"


def logits_of(model, tokens=PROMPT) -> torch.Tensor:
    sess = DirectSession(model, max_requests=1, max_tokens=64)
    rid = sess.new_request()
    return sess.step({rid: tokens})[rid]


def rewrite(src, dst, edit) -> None:
    """Copy a single-file checkpoint dir, passing its tensors through `edit(dict)`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def dequant(q: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """W = fp8 * scale_inv[i // 128, j // 128], written out with explicit expansion."""
    o, i = q.shape[-2:]
    full = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :o, :i]
    return q.float() * full


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return preset_config("tiny")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def nested_dir(tiny, root):
    d = root / "nested"
    write_checkpoint(tiny, str(d), seed=3, dtype="float32", layout="nested", tokenizer=False, progress=False)
    return d


@pytest.fixture(scope="module")
def nested_model(nested_dir):
    model, report = load_checkpoint(nested_dir, ReferenceOps(), dtype=torch.float32)
    return model, report


@pytest.fixture(scope="module")
def nested_logits(nested_model):
    return logits_of(nested_model[0])


@pytest.fixture(scope="module")
def fp8_dir(tiny, root):
    d = root / "fp8"
    write_checkpoint(tiny, str(d), seed=5, dtype="fp8", tokenizer=False, progress=False)
    return d


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    return load_checkpoint(fp8_dir, ReferenceOps(), dtype=torch.float32)[0]


# ---- layouts and shards ------------------------------------------------------------------------------

def test_nested_checkpoint_holds_the_hf_names(nested_dir, tiny):
    with safe_open(str(nested_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    assert "model.language_model.layers.0.self_attn.q_conv1d.weight" in keys
    assert "model.language_model.layers.2.mlp.experts.7.down_proj.weight" in keys
    assert "model.visual.patch_embed.proj.weight" in keys
    n = tiny.text.num_hidden_layers
    assert any(k.startswith(f"model.language_model.layers.{n}.") for k in keys)  # the MTP layer
    assert not any(k.startswith("model.layers.") for k in keys)


def test_every_checkpoint_tensor_lands_in_its_parameter(nested_dir, nested_model, tiny):
    model, report = nested_model
    params = dict(model.named_parameters())
    n = tiny.text.num_hidden_layers
    seen = set()
    with safe_open(str(nested_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for key in keys:
            name, expert = internal_name(key, n)
            assert name in params, key
            p = params[name] if expert is None else params[name][expert]
            assert torch.equal(p, f.get_tensor(key)), key
            seen.add(name)
    assert seen == set(params), f"parameters never filled: {sorted(set(params) - seen)[:10]}"
    assert report.num_tensors == len(keys) and report.skipped == []
    assert report.num_bytes == (nested_dir / "model.safetensors").stat().st_size


def test_flat_layout_loads_identically(tiny, root, nested_model):
    d = root / "flat"
    write_checkpoint(tiny, str(d), seed=3, dtype="float32", layout="flat", tokenizer=False, progress=False)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.patch_embed.proj.weight" in keys
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in keys)
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    assert_same_state(model, nested_model[0])


def test_sharded_checkpoint_loads_identically(tiny, root, nested_model):
    d = root / "sharded"
    summary = write_checkpoint(tiny, str(d), seed=3, dtype="float32", shard_bytes=200_000, tokenizer=False,
                               progress=False)
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert summary["shards"] == len(shards) >= 3
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert {v for v in index["weight_map"].values()} == {p.name for p in shards}
    for p in shards:
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == p.name
    model, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    assert_same_state(model, nested_model[0])


def test_seed_changes_the_weights(tiny, root, nested_dir):
    d = root / "seed4"
    write_checkpoint(tiny, str(d), seed=4, dtype="float32", tokenizer=False, progress=False)
    a = load_file(str(nested_dir / "model.safetensors"))
    b = load_file(str(d / "model.safetensors"))
    assert a.keys() == b.keys()
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


# ---- HF reads what we write -----------------------------------------------------------------------

def test_hf_loads_the_nested_checkpoint(nested_dir, nested_model, tiny):
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.Glm5NextForConditionalGeneration.from_pretrained(
        str(nested_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"], sorted(info["missing_keys"])[:10]
    assert not info.get("mismatched_keys")
    n = tiny.text.num_hidden_layers
    unexpected = sorted(info["unexpected_keys"])
    assert unexpected, "the MTP layer should be reported as unexpected by HF"
    assert all(f"layers.{n}." in k for k in unexpected), [k for k in unexpected if f"layers.{n}." not in k]
    ours = nested_model[0]
    hs = hf.state_dict()
    assert torch.equal(hs["lm_head.weight"], ours.lm_head.weight)
    assert torch.equal(hs["model.language_model.embed_tokens.weight"], ours.model.embed_tokens.weight)


# ---- strictness -----------------------------------------------------------------------------------------

def test_missing_tensor_is_named(nested_dir, tmp_path):
    key = "model.language_model.layers.1.self_attn.kv_b_proj.weight"
    rewrite(nested_dir, tmp_path / "c", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    assert "layers.1.self_attn.kv_b_proj.weight" in str(e.value)


def test_unexpected_tensor_is_named(nested_dir, tmp_path):
    key = "model.language_model.layers.0.self_attn.bogus_proj.weight"
    rewrite(nested_dir, tmp_path / "c", lambda t: t.__setitem__(key, torch.zeros(4, 4)))
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    assert key in str(e.value)


def test_tensor_beyond_the_mtp_layers_is_unexpected(nested_dir, tmp_path, tiny):
    key = f"model.language_model.layers.{tiny.text.num_hidden_layers + 1}.enorm.weight"
    rewrite(nested_dir, tmp_path / "c", lambda t: t.__setitem__(key, torch.ones(64)))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    assert key in str(e.value)


def test_wrong_shape_is_named(nested_dir, tmp_path):
    key = "model.language_model.layers.4.self_attn.q_a_proj.weight"

    def edit(t):
        t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
    rewrite(nested_dir, tmp_path / "c", edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    assert key in str(e.value) and "shape" in str(e.value)


def test_missing_expert_names_the_experts_param(nested_dir, tmp_path):
    key = "model.language_model.layers.3.mlp.experts.5.up_proj.weight"
    rewrite(nested_dir, tmp_path / "c", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    msg = str(e.value)
    assert "model.layers.3.mlp.experts.up_proj.weight" in msg and "5" in msg.split("experts.up_proj.weight", 1)[1]


def test_fp8_weight_without_scale_is_rejected(fp8_dir, tmp_path):
    key = "model.language_model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    rewrite(fp8_dir, tmp_path / "c", lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)
    assert "layers.1.self_attn.q_b_proj.weight" in str(e.value)


def test_no_safetensors_is_an_error(nested_dir, tmp_path):
    (tmp_path / "c").mkdir()
    shutil.copy(nested_dir / "config.json", tmp_path / "c" / "config.json")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path / "c", ReferenceOps(), dtype=torch.float32)


# ---- MTP and vision ---------------------------------------------------------------------------------------

def test_mtp_layer_is_loaded(nested_dir, nested_model, tiny):
    model = nested_model[0]
    assert model.mtp is not None
    n = tiny.text.num_hidden_layers
    pre = f"model.language_model.layers.{n}."
    with safe_open(str(nested_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(model.mtp.eh_proj.weight, f.get_tensor(pre + "eh_proj.weight"))
        assert torch.equal(model.mtp.enorm.weight, f.get_tensor(pre + "enorm.weight"))
        assert torch.equal(model.mtp.shared_head.norm.weight, f.get_tensor(pre + "shared_head.norm.weight"))
        assert torch.equal(model.mtp.self_attn.indexer.wk.weight, f.get_tensor(pre + "self_attn.indexer.wk.weight"))
        assert torch.equal(model.mtp.mlp.experts.gate_proj.weight[6],
                           f.get_tensor(pre + "mlp.experts.6.gate_proj.weight"))
        mtp_keys = [k for k in f.keys() if k.startswith(pre)]
    assert len(mtp_keys) == sum(p.shape[0] if ".experts." in name else 1
                                for name, p in model.mtp.named_parameters())
    # the draft layer differs from the last target layer's weights (really its own tensors)
    assert not torch.equal(model.mtp.self_attn.q_a_proj.weight, model.model.layers[4].self_attn.q_a_proj.weight)


def test_without_mtp(nested_dir, tiny, nested_logits):
    model, report = load_checkpoint(nested_dir, ReferenceOps(), dtype=torch.float32, with_mtp=False)
    n = tiny.text.num_hidden_layers
    assert model.mtp is None
    assert report.skipped and all(k.startswith(f"model.language_model.layers.{n}.") for k in report.skipped)
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())
    torch.testing.assert_close(logits_of(model), nested_logits, rtol=0, atol=0)


def test_without_vision(nested_dir, nested_logits):
    model, report = load_checkpoint(nested_dir, ReferenceOps(), dtype=torch.float32, with_vision=False)
    assert model.visual is None and model.mtp is not None
    assert report.skipped and all(k.startswith("model.visual.") for k in report.skipped)
    assert "model.visual.patch_embed.proj.weight" in report.skipped
    torch.testing.assert_close(logits_of(model), nested_logits, rtol=0, atol=0)


def test_loaded_model_runs(nested_logits, tiny):
    assert nested_logits.shape == (len(PROMPT), tiny.text.vocab_size)
    assert torch.isfinite(nested_logits).all()
    assert nested_logits.std() > 0.5  # the peaky head of the preset, not a dead model


# ---- FP8 ----------------------------------------------------------------------------------------------------

def test_fp8_checkpoint_format(fp8_dir):
    cfg = json.loads((fp8_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    assert q.get("fmt", "e4m3") == "e4m3"
    quantised, big_scale = [], False
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for k in sorted(keys):
            if not k.endswith(".weight_scale_inv"):
                continue
            w, s = f.get_tensor(k[: -len("_scale_inv")]), f.get_tensor(k)
            assert w.dtype == FP8, k
            assert s.dtype == torch.float32, k
            assert tuple(s.shape) == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128)), k
            assert (s > 0).all(), k
            big_scale |= s.numel() > 1
            quantised.append(k[: -len("_scale_inv")])
        for k in keys:
            if f.get_tensor(k).dtype == FP8:
                assert k + "_scale_inv" in keys, f"{k} is fp8 without a scale"
    assert big_scale, "some tiny weight should span more than one 128-block"
    L = "model.language_model.layers."
    for k in (L + "0.self_attn.q_proj.weight", L + "0.mlp.gate_proj.weight", L + "0.mlp.down_proj.weight",
              L + "1.self_attn.q_b_proj.weight", L + "1.self_attn.indexer.wq_b.weight",
              L + "2.mlp.experts.3.gate_proj.weight", L + "2.mlp.shared_experts.up_proj.weight"):
        assert k in quantised, k
    for k in ("lm_head.weight", "model.language_model.embed_tokens.weight", L + "2.mlp.gate.weight",
              L + "0.input_layernorm.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert k in keys and k not in quantised, k


def test_fp8_model_layers(fp8_dir, fp8_model, tiny):
    n = tiny.text.num_hidden_layers
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        scaled = {internal_name(k[: -len(".weight_scale_inv")], n)[0] for k in f.keys()
                  if k.endswith(".weight_scale_inv")}
        fp8_mods = {name for name, m in fp8_model.named_modules()
                    if isinstance(m, (Linear, StackedLinear)) and m.is_fp8}
        assert fp8_mods == scaled
        for name in sorted(fp8_mods):
            m = fp8_model.get_submodule(name)
            assert m.weight.dtype == FP8 and m.weight_scale_inv.dtype == torch.float32
        assert fp8_model.model.layers[0].mlp.gate_proj.is_fp8
        assert fp8_model.model.layers[2].mlp.experts.down_proj.is_fp8
        assert not fp8_model.lm_head.is_fp8
        key = "model.language_model.layers.1.self_attn.indexer.wq_b.weight"
        m = fp8_model.model.layers[1].self_attn.indexer.wq_b
        assert same(m.weight.data, f.get_tensor(key))
        assert torch.equal(m.weight_scale_inv, f.get_tensor(key + "_scale_inv"))
        key = "model.language_model.layers.3.mlp.experts.6.up_proj.weight"
        ex = fp8_model.model.layers[3].mlp.experts.up_proj
        assert same(ex.weight.data[6], f.get_tensor(key))
        assert torch.equal(ex.weight_scale_inv[6], f.get_tensor(key + "_scale_inv"))


def test_fp8_logits_match_the_dequantised_float32_model(fp8_dir, fp8_model, root):
    # An independent float32 checkpoint holding W = fp8 * expanded scale, no quantization_config.
    d = root / "fp8-dequantised"
    d.mkdir()
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    cfg["torch_dtype"] = "float32"
    (d / "config.json").write_text(json.dumps(cfg))
    src = load_file(str(fp8_dir / "model.safetensors"))
    out = {}
    for k, v in src.items():
        if k.endswith(".weight_scale_inv"):
            continue
        out[k] = dequant(v, src[k + "_scale_inv"]) if k + "_scale_inv" in src else v.float()
    save_file(out, str(d / "model.safetensors"))
    ref, _ = load_checkpoint(d, ReferenceOps(), dtype=torch.float32)
    assert not any(isinstance(m, (Linear, StackedLinear)) and m.is_fp8 for m in ref.modules())
    a, b = logits_of(fp8_model), logits_of(ref)
    assert torch.isfinite(a).all()
    err = (a - b).abs().max().item()
    assert err <= 1e-5 * b.abs().max().item(), err


@pytest.mark.parametrize("shape", [(200, 300), (129, 1), (3, 130, 257), (64, 700)])
def test_quantize_block_fp8_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g)
    # vary the magnitude across blocks so the scales differ
    w = w * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    q, s = quantize_block_fp8(w, (128, 128))
    o, i = shape[-2:]
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == (*shape[:-2], math.ceil(o / 128), math.ceil(i / 128))
    # scale = block amax / 448, partial edge blocks included
    for bo in range(s.shape[-2]):
        for bi in range(s.shape[-1]):
            blk = w[..., bo * 128:(bo + 1) * 128, bi * 128:(bi + 1) * 128]
            amax = blk.abs().amax(dim=(-2, -1))
            torch.testing.assert_close(s[..., bo, bi], amax / E4M3_MAX, rtol=1e-6, atol=0)
    deq = dequant(q, s)
    assert torch.isfinite(deq).all()
    err = (deq - w).abs()
    se = s.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :o, :i]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4 for normals; subnormal spacing is 2^-9 * scale
    bound = torch.maximum(w.abs() * 2.0 ** -4, se * 2.0 ** -10) * (1 + 1e-5)
    assert (err <= bound).all(), (err / bound).max()
    normal = w.abs() >= se * 2.0 ** -6
    rel = err[normal] / w.abs()[normal]
    assert rel.max() <= 2.0 ** -3
    assert rel.mean() < 2.0 ** -5
    # the largest element of each tensor sits at 448 and comes back (almost) exactly
    k = w.abs().argmax()
    assert err.flatten()[k] <= 1e-6 * w.abs().flatten()[k]


def test_quantize_block_fp8_zero_block():
    w = torch.zeros(130, 140)
    w[:128, :128] = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    q, s = quantize_block_fp8(w, (128, 128))
    deq = dequant(q, s)
    assert torch.isfinite(s).all() and torch.isfinite(deq).all()
    assert torch.equal(deq[128:], torch.zeros(2, 140)) and torch.equal(deq[:, 128:], torch.zeros(130, 12))


# ---- random-weight models -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dummy_f32(tiny):
    return load_dummy(tiny, ReferenceOps(), dtype=torch.float32)


def test_load_dummy_float32_runs(dummy_f32, tiny):
    logits = logits_of(dummy_f32)
    assert logits.shape == (len(PROMPT), tiny.text.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.5
    assert not any(isinstance(m, (Linear, StackedLinear)) and m.is_fp8 for m in dummy_f32.modules())
    assert dummy_f32.mtp is not None and dummy_f32.visual is not None


def test_load_dummy_fp8_runs(tiny, dummy_f32):
    model = load_dummy(tiny, ReferenceOps(), dtype=torch.float32, quantization="fp8")
    fp8 = [n for n, m in model.named_modules() if isinstance(m, (Linear, StackedLinear)) and m.is_fp8]
    assert fp8 and "model.layers.0.mlp.gate_proj" in fp8 and "lm_head" not in fp8
    assert all(model.get_submodule(n).weight.dtype == FP8 for n in fp8)
    logits = logits_of(model)
    assert torch.isfinite(logits).all() and logits.std() > 0.5
    # the fp8 layers hold the float32 model's random values, block-quantised (scales included)
    for n in fp8:
        m, ref = model.get_submodule(n), dummy_f32.get_submodule(n).weight
        w = dequant(m.weight, m.weight_scale_inv)
        assert (w - ref).norm() <= 2.0 ** -4 * ref.norm(), n
        assert not torch.equal(w, ref), n
    assert torch.equal(model.lm_head.weight, dummy_f32.lm_head.weight)


def test_load_dummy_is_deterministic(tiny, dummy_f32):
    again = load_dummy(tiny, ReferenceOps(), dtype=torch.float32)
    assert_same_state(again, dummy_f32)
    other = load_dummy(tiny, ReferenceOps(), dtype=torch.float32, seed=1)
    assert not torch.equal(other.lm_head.weight, dummy_f32.lm_head.weight)
    a = load_dummy(tiny, ReferenceOps(), dtype=torch.float32, quantization="fp8", seed=2)
    b = load_dummy(tiny, ReferenceOps(), dtype=torch.float32, quantization="fp8", seed=2)
    assert_same_state(a, b)


def test_load_dummy_rejects_unknown_quantization(tiny):
    with pytest.raises(ValueError, match="quantization"):
        load_dummy(tiny, ReferenceOps(), dtype=torch.float32, quantization="int4")
