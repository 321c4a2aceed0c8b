"""`glmrt make-checkpoint`, run as the real console script."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from glmrt.checkpoint.presets import preset_config
from glmrt.checkpoint.writer import checkpoint_bytes

torch.set_num_threads(1)

GLMRT = shutil.which("glmrt", path=str(Path(sys.executable).parent)) or shutil.which("glmrt")
TIMEOUT = 120


def _glmrt():
    if GLMRT is None:
        pytest.skip("the glmrt console script is not installed")
    return GLMRT


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every command at once (each spends most of its time importing torch), then collect."""
    exe = _glmrt()
    root = tmp_path_factory.mktemp("cli")
    cmds = {
        "tiny": [exe, "make-checkpoint", "--preset", "tiny", "--out", str(root / "tiny")],
        "meta": [exe, "make-checkpoint", "--preset", "flash", "--meta"],
        "fit": [exe, "make-checkpoint", "--preset", "flash", "--meta", "--tp-size", "4", "--ep-size", "4",
                "--quantization", "fp8", "--gpu-memory-gb", "141"],
        "fit_bad_tp": [exe, "make-checkpoint", "--preset", "flash", "--meta", "--tp-size", "3"],
        "large": [exe, "make-checkpoint", "--preset", "flash-4l", "--out", str(root / "f4l")],
        "unknown": [exe, "make-checkpoint", "--preset", "nope", "--out", str(root / "nope")],
    }
    procs = {k: (subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), time.monotonic())
             for k, c in cmds.items()}
    out = {}
    for k, (p, t0) in procs.items():
        try:
            so, se = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        out[k] = {"rc": p.returncode, "stdout": so, "stderr": se, "wall": time.monotonic() - t0}
    out["root"] = root
    return out


def test_tiny_exits_0_and_prints_sizes(runs):
    r = runs["tiny"]
    assert r["rc"] == 0, r["stderr"]
    assert "wrote tiny" in r["stdout"] and "MiB" in r["stdout"]
    assert re.search(r"total\s+[\d.]+ B", r["stdout"])
    assert "checkpoint size" in r["stdout"]


def test_tiny_writes_every_file(runs):
    d = runs["root"] / "tiny"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (d / name).is_file(), name
        assert (d / name).stat().st_size > 0, name
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert isinstance(tc.get("chat_template"), str) and "<|assistant|>" in tc["chat_template"]


# A file a template names: a name with a document or code suffix, with its directories if any.
_FILE_REF = re.compile(r"(?:[\w.-]+/)*[\w-]+\.(?:md|rst|txt|json|jinja2?|py|html)\b")


def template_file_refs(template: str) -> list[str]:
    """The file names a chat template mentions (in its comments or its text)."""
    return _FILE_REF.findall(template)


def test_template_file_refs_finds_a_path():
    assert template_file_refs("{#- layout: see docs/PROTOCOLS.md -#}<|user|></think>") == ["docs/PROTOCOLS.md"]
    assert template_file_refs("{#- see NOTES.md -#}") == ["NOTES.md"]
    assert template_file_refs("../elsewhere/docs/MODEL.md") == ["../elsewhere/docs/MODEL.md"]
    assert template_file_refs("<|assistant|><think></think><tool_call>{function-name}</tool_call> a key/value pair") == []


def test_tiny_template_names_no_missing_file(runs):
    """The template travels inside tokenizer_config.json: a file it points a reader to must be
    in the checkpoint directory, or the pointer leads nowhere."""
    d = runs["root"] / "tiny"
    template = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    missing = [ref for ref in template_file_refs(template) if not (d / ref).exists()]
    assert missing == []

def test_tiny_generation_config(runs):
    d = runs["root"] / "tiny"
    v = preset_config("tiny").text.vocab_size
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["temperature"] == 1.0 and gen["top_p"] == 0.95
    assert gen["eos_token_id"] == [v - 60, v - 53, v - 51]


def test_tiny_config_matches_the_tokenizer(runs):
    from tokenizers import Tokenizer

    d = runs["root"] / "tiny"
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    v = cfg["text_config"]["vocab_size"]
    assert v == preset_config("tiny").text.vocab_size
    assert tok.get_vocab_size(with_added_tokens=True) == v
    expected = {"image_token_id": "<|image|>", "video_token_id": "<|video|>",
                "image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
                "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"}
    for field, token in expected.items():
        assert cfg[field] == tok.token_to_id(token), field
    assert cfg["text_config"]["pad_token_id"] == tok.token_to_id("<|endoftext|>")
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    assert cfg["text_config"]["eos_token_id"] == gen["eos_token_id"]


def test_tiny_checkpoint_loads(runs):
    from backends.reference import ReferenceOps
    from glmrt.config import load_model_config
    from glmrt.model.loader import load_checkpoint

    d = runs["root"] / "tiny"
    assert load_model_config(d) == preset_config("tiny")
    model, report = load_checkpoint(d, ReferenceOps(), dtype=torch.bfloat16)
    assert model.mtp is not None and model.visual is not None and not report.skipped


def test_flash_meta(runs):
    r = runs["meta"]
    assert r["rc"] == 0, r["stderr"]
    assert r["wall"] < 60
    m = re.search(r"^\s*total\s+([\d.]+) B", r["stdout"], re.M)
    assert m, r["stdout"]
    assert 318 < float(m.group(1)) < 325  # ~321 B with the MTP layer
    assert re.search(r"^\s*1,048,576\s+[\d.]+ MiB", r["stdout"], re.M), r["stdout"]
    assert "45 layers (34 KDA, 11 DSA" in r["stdout"]


def test_large_preset_needs_force(runs):
    r = runs["large"]
    assert r["rc"] == 2
    assert "--force" in r["stderr"]
    gib = checkpoint_bytes(preset_config("flash-4l"), "bfloat16") / 2**30
    assert f"{gib:.1f} GiB" in r["stderr"], r["stderr"]
    assert gib > 10
    assert not (runs["root"] / "f4l").exists()


def test_unknown_preset(runs):
    r = runs["unknown"]
    assert r["rc"] == 2
    for name in ("tiny", "flash-4l", "flash"):
        assert name in r["stderr"]
    assert "nope" in r["stderr"]
    assert not (runs["root"] / "nope").exists()


def test_flash_meta_prints_the_per_gpu_plan(runs):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.fit import GB, GIB, engine_fit

    r = runs["fit"]
    assert r["rc"] == 0, r["stderr"]
    plan = engine_fit(preset_config("flash"), EngineConfig(load_format="dummy", quantization="fp8"),
                      gpu_bytes=141 * GB, kv_dtype="bfloat16", tp_size=4, ep_size=4)
    out = r["stdout"]
    assert "per GPU at tp 4, ep 4 (fp8 weights, bfloat16 KV, float32 state" in out
    assert re.search(rf"weights \(per rank\):\s+{plan.weight_bytes / GIB:.2f} GiB", out), out
    assert re.search(rf"cache pools:\s+{plan.budget_bytes / GIB:.2f} GiB", out), out
    m = plan.memory
    assert f"{m.num_pages} pages x 64 = {m.kv_tokens} tokens" in out and f"{m.num_slots} slots" in out
    assert f"max_running_requests: {m.max_running_requests}" in out and out.rstrip().endswith("fits")
    # the default: one rank of bf16 weights does not fit on one H200
    assert re.search(r"does not fit: weights [\d.]+ GiB \+ runtime reserve 1.00 GiB exceed the GPU's 131.32 GiB",
                     runs["meta"]["stdout"]), runs["meta"]["stdout"]


def test_a_tp_size_the_model_does_not_divide_is_refused(runs):
    r = runs["fit_bad_tp"]
    assert r["rc"] == 2 and "is not divisible by 3 ranks" in r["stderr"], r["stderr"]
