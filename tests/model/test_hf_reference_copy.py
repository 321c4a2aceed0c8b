"""bench.hf_reference (HF model filled from ours in memory) and the bench.model_parity CLI, on CPU.

The copy must place every one of our tensors (renames, q|k|v conv concatenation, gate|up
expert stacking, vision) and fill every HF parameter and buffer, the rotary inv_freq
included; in fp32 the two models must then agree to 1e-4 relative on the tiny preset.
"""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(1)

pytest.importorskip("transformers")

from backends.reference import ReferenceOps  # noqa: E402
from bench import model_parity  # noqa: E402
from bench.hf_reference import (  # noqa: E402
    build_hf_from_ours,
    hf_logits,
    hf_logits_incremental,
    round_ours_to_hf_,
)
from glmrt.checkpoint.presets import preset_config  # noqa: E402
from glmrt.model.loader import load_dummy  # noqa: E402
from glmrt.model.session import DirectSession  # noqa: E402

TOL = 1e-4
PROMPT_LEN = 70  # > index_topk (16) of tiny: sparse selection drops tokens


def _config(name: str):
    cfg = preset_config("tiny")
    if name == "tiny-bias":  # attention biases and the softplus KDA gate
        cfg = cfg.replace_text(attention_bias=True, linear_lower_bound=None)
    return cfg


@pytest.fixture(scope="module", params=["tiny", "tiny-bias"])
def pair(request):
    ours = load_dummy(_config(request.param), ReferenceOps(), dtype=torch.float32, device="cpu", seed=1)
    return ours, build_hf_from_ours(ours, "cpu", torch.float32)


def _prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab - 60, (n,), generator=torch.Generator().manual_seed(seed))


def test_every_tensor_lands_where_hf_expects_it(pair):
    ours, hf = pair
    o = dict(ours.named_parameters())
    h = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    lm = "model.language_model.layers"
    q = o["model.layers.0.self_attn.q_proj.weight"].shape[0]
    conv = h[f"{lm}.0.self_attn.conv1d.weight"]
    for i, x in enumerate("qkv"):
        assert torch.equal(conv[i * q:(i + 1) * q], o[f"model.layers.0.self_attn.{x}_conv1d.weight"])
    inter = o["model.layers.2.mlp.experts.gate_proj.weight"].shape[1]
    gate_up = h[f"{lm}.2.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[:, :inter], o["model.layers.2.mlp.experts.gate_proj.weight"])
    assert torch.equal(gate_up[:, inter:], o["model.layers.2.mlp.experts.up_proj.weight"])
    assert torch.equal(h[f"{lm}.2.mlp.experts.down_proj"], o["model.layers.2.mlp.experts.down_proj.weight"])
    assert torch.equal(h[f"{lm}.2.mlp.gate.e_score_correction_bias"], o["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert torch.equal(h[f"{lm}.0.self_attn.forget_gate.A_log"], o["model.layers.0.self_attn.A_log"])
    assert torch.equal(h[f"{lm}.0.self_attn.forget_gate.f_b_proj.weight"], o["model.layers.0.self_attn.f_b_proj.weight"])
    assert torch.equal(h[f"{lm}.1.ffn_hc.fn"], o["model.layers.1.hc_ffn_fn"])
    assert torch.equal(h[f"{lm}.1.self_attn.indexer.index_kpool_compress_ape"],
                       o["model.layers.1.self_attn.indexer.index_kpool_compress_ape"])
    assert torch.equal(h["model.visual.blocks.1.attn.qkv.weight"], o["visual.blocks.1.attn.qkv.weight"])
    assert torch.equal(h["lm_head.weight"], o["lm_head.weight"])
    rot = hf.model.visual.rotary_pos_emb
    want, _ = rot.compute_axial_rope_parameters(rot.config)
    assert torch.equal(rot.inv_freq, want) and torch.equal(rot.original_inv_freq, want)
    if ours.config.text.attention_bias:
        assert torch.equal(h[f"{lm}.1.self_attn.o_proj.bias"], o["model.layers.1.self_attn.o_proj.bias"])


def test_full_sequence_logits_match_fp32(pair):
    ours, hf = pair
    ids = _prompt(ours.config.text.vocab_size)
    ref = hf_logits(hf, ids[None])[0]
    sess = DirectSession(ours, max_requests=1, max_tokens=128)
    rid = sess.new_request()
    got = sess.step({rid: ids}, all_logits=True)[rid]
    err = (got - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    print(f"full sequence: max abs {err:.2e}, rel {rel:.2e}")
    assert rel <= TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    inc = hf_logits_incremental(hf, ids[None], [40, 29, 1])[0]
    assert (inc - ref).abs().max().item() / ref.abs().max().item() <= TOL


def test_unfilled_hf_tensors_are_reported():
    ours = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.float32, device="cpu", with_vision=False)
    with pytest.raises(RuntimeError, match="model.visual.blocks"):
        build_hf_from_ours(ours, "cpu", torch.float32)


def test_bf16_dtypes_follow_from_pretrained():
    ours = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.bfloat16, device="cpu", with_mtp=False)
    rounded = round_ours_to_hf_(ours, torch.bfloat16)
    assert rounded and all(".hc_" in n for n in rounded)
    hf = build_hf_from_ours(ours, "cpu", torch.bfloat16)
    keep = ("conv1d", "A_log", "dt_bias", "e_score_correction_bias", "inv_freq")
    for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
        assert t.dtype == (torch.float32 if any(k in name for k in keep) else torch.bfloat16), name
    # after rounding, ours holds exactly HF's (bf16) mHC values
    assert torch.equal(ours.model.layers[3].hc_attn_fn, hf.model.language_model.layers[3].attn_hc.fn.float())


def test_cli_main_fp32(tmp_path, capsys):
    out = tmp_path / "r.json"
    res = model_parity.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "70",
                             "--decode-steps", "4", "--chunk", "32", "--seed", "0", "--out", str(out)])
    printed = capsys.readouterr().out.strip().splitlines()
    assert res["prefill"]["positions"] == 70 and res["decode"]["positions"] == 4
    for part in ("prefill", "decode"):
        c = res[part]
        assert c["top1_agreement"] == 1.0, c
        assert c["max_rel_err"] <= TOL and 0 < c["max_abs_ref"] and c["mean_abs_err"] <= c["max_abs_err"]
    assert len(res["greedy_tokens"]) == 4
    assert res["time_s"]["ours_prefill"] > 0 and res["time_s"]["hf_forward"] > 0
    assert json.loads(out.read_text())["prefill"] == res["prefill"]
    # HF against itself (cached path on our schedule vs full forward): the noise floor
    for part in ("prefill", "decode"):
        assert res["hf_self"][part]["top1_agreement"] == 1.0 and res["hf_self"][part]["max_rel_err"] <= TOL
    # the table comes last (on CPU it has no memory row)
    assert [line.split()[0] for line in printed[-6:]] == ["pos", "prefill", "decode", "hf-self", "hf-self", "time"]


def test_default_prompt_fits_an_h200_and_drops_tokens():
    cfg = preset_config("flash-4l")
    ours_w, hf_w = model_parity._meta_bytes(cfg, torch.bfloat16)
    assert 55 << 30 < ours_w < 62 << 30 and abs(ours_w - hf_w) < 1 << 28
    h200 = 143771 << 20
    one = {"devices": ("cuda:0", "cuda:0")}
    plan = model_parity.plan_memory(cfg.text, ours_w, hf_w, model_parity.DEFAULT_PROMPT_LEN, 16, 1024,
                                    torch.bfloat16, **one)
    assert plan["required_bytes"]["cuda:0"] <= h200
    assert model_parity.DEFAULT_PROMPT_LEN + 16 > cfg.text.index_topk
    too_long = model_parity.plan_memory(cfg.text, ours_w, hf_w, 8192, 16, 1024, torch.bfloat16, **one)
    assert too_long["required_bytes"]["cuda:0"] > h200
    # an fp32 reference copy needs a second H200 of its own
    ref = model_parity.plan_memory(cfg.text, ours_w, hf_w, model_parity.DEFAULT_PROMPT_LEN, 16, 1024,
                                   torch.bfloat16, devices=("cuda:0", "cuda:0"), ref32=("cuda:1", 2 * hf_w))
    assert ref["required_bytes"]["cuda:0"] == plan["required_bytes"]["cuda:0"]
    assert ref["required_bytes"]["cuda:1"] <= h200


@pytest.mark.parametrize("case", ["tied", "fp8"])
def test_tied_head_and_fp8_weights(case):
    cfg = preset_config("tiny")
    if case == "tied":
        cfg = cfg.replace_text(tie_word_embeddings=True)
    ours = load_dummy(cfg, ReferenceOps(), dtype=torch.float32, device="cpu", seed=2,
                      quantization="fp8" if case == "fp8" else None)
    hf = build_hf_from_ours(ours, "cpu", torch.float32)  # fp8: dequantised into HF's dense weights
    if case == "tied":
        assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    ids = _prompt(cfg.text.vocab_size)
    ref = hf_logits(hf, ids[None])[0]
    sess = DirectSession(ours, max_requests=1, max_tokens=128)
    rid = sess.new_request()
    got = sess.step({rid: ids}, all_logits=True)[rid]
    assert (got - ref).abs().max().item() / ref.abs().max().item() <= TOL
