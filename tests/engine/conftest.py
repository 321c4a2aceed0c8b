"""The engine tests' shared model: the tiny preset written in fp32, loaded on the reference backend."""

from __future__ import annotations

import pytest
import torch

from glmrt.checkpoint.presets import preset_config
from glmrt.checkpoint.writer import write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(preset_config("tiny"), str(path), seed=0, dtype="float32")
    return str(path)


@pytest.fixture(scope="module")
def model(ckpt):
    from backends.reference import ReferenceOps
    from glmrt.model.loader import load_checkpoint
    m, _ = load_checkpoint(ckpt, ReferenceOps(), dtype=torch.float32, with_mtp=False)
    return m
