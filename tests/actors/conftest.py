"""The actor tests' shared pieces: the tiny checkpoint, and run specs as an actor process gets them."""

from __future__ import annotations

import pytest

from actors.base import RunSpec, decode_run_specs, encode_run_specs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from glmrt.checkpoint.presets import preset_config
    from glmrt.checkpoint.writer import write_checkpoint
    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(preset_config("tiny"), str(path), seed=0, dtype="float32")
    return str(path)


def run_spec(kind: str, run_dir, config) -> RunSpec:
    """The run spec as an actor process receives it: through its command-line encoding."""
    (spec,) = decode_run_specs(encode_run_specs([RunSpec(kind, 0, str(run_dir), config=config)]))
    return spec
