"""`glmrt make-checkpoint --from DIR --dtype fp8`: a checkpoint's own weights re-written as
block-scaled fp8 (the shipped trained model), loadable, close to the source, and refused when
the source is already quantised."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from backends.reference import ReferenceOps
from cli.up import embedded_checkpoint
from glmrt.model.loader import load_checkpoint
from glmrt.model.session import DirectSession


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "make-checkpoint", *args], capture_output=True, text=True,
                          timeout=300)


def test_the_shipped_model_converts_to_fp8_and_keeps_its_predictions(tmp_path):
    src, out = embedded_checkpoint(), tmp_path / "fp8"
    r = make("--from", src, "--dtype", "fp8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert (out / "tokenizer.json").read_text() == open(f"{src}/tokenizer.json").read()
    prompt = list(range(20, 60))
    logits = []
    for path in (src, out):
        model, _ = load_checkpoint(str(path), ReferenceOps(), dtype=torch.float32, with_vision=False)
        sess = DirectSession(model, max_requests=1, max_tokens=64)
        rid = sess.new_request()
        logits.append(sess.step({rid: prompt})[rid])
    a, b = logits
    assert not torch.equal(a, b)  # really re-quantised
    assert a[-1].argmax() == b[-1].argmax()
    assert torch.nn.functional.cosine_similarity(a[-1], b[-1], dim=0) > 0.99

    again = make("--from", str(out), "--dtype", "fp8", "--out", str(tmp_path / "twice"))
    assert again.returncode == 2 and "already quantised" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
