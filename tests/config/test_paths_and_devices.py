"""`~` in the topology's paths, and the GPU count `glmrt up` checks `gpus` against (read from device
files, no torch)."""

from __future__ import annotations

import os

import pytest

from glmrt.devices import gpu_count
from glmrt.topology import TopologyError, parse_topology
from glmrt.topology_checks import validate

ACTORS = [{"kind": "tokenizer"}, {"kind": "engine", "gpus": [0]}, {"kind": "detokenizer"}]


def test_home_in_a_path_is_expanded_where_it_is_read(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    topo = parse_topology({"model": {"path": "~/ckpt/tiny"}, "api": {"allowed_local_media_path": "~/media"}})
    assert topo.model.path == os.path.join(str(tmp_path), "ckpt", "tiny")
    assert topo.api.allowed_local_media_path == os.path.join(str(tmp_path), "media")
    assert topo.engine_config(topo.actor("engine")).model == os.path.join(str(tmp_path), "ckpt", "tiny")


def test_gpus_without_a_gpu_are_refused():
    topo = parse_topology({"actors": ACTORS})
    with pytest.raises(TopologyError, match=r"^engine: gpus = \[0\], but this machine has no GPU; leave gpus out"):
        validate(topo, num_gpus=0)
    validate(topo, num_gpus=1)
    validate(parse_topology({}), num_gpus=0)   # nothing placed on a GPU: the engine runs on the CPU


def test_gpu_count_reads_the_device_files(tmp_path):
    dev, nodes = tmp_path / "dev", tmp_path / "nodes"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).write_text("")
    for node, gpu_id in (("0", "0"), ("1", "43512"), ("2", "0")):   # the CPU nodes have gpu_id 0
        (nodes / node).mkdir(parents=True)
        (nodes / node / "gpu_id").write_text(gpu_id + "\n")
    assert gpu_count(str(dev), str(nodes)) == 3
    assert gpu_count(str(tmp_path / "none"), str(tmp_path / "none")) == 0


def test_gpu_free_memory_from_nvidia_smi_or_the_amdgpu_files(tmp_path, monkeypatch):
    import subprocess

    from glmrt.devices import gpu_free_bytes

    def smi(cmd, **kw):
        assert cmd[0] == "nvidia-smi"
        return subprocess.CompletedProcess(cmd, 0, "0, 143000\n1, 1024\n", "")

    monkeypatch.setattr(subprocess, "run", smi)
    assert gpu_free_bytes([1, 0]) == {1: 1024 * 2**20, 0: 143000 * 2**20}
    assert gpu_free_bytes([2]) is None

    def absent(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(subprocess, "run", absent)
    for i, (total, used) in enumerate(((300, 100), (500, 0))):
        d = tmp_path / f"card{i}" / "device"
        d.mkdir(parents=True)
        (d / "mem_info_vram_total").write_text(str(total))
        (d / "mem_info_vram_used").write_text(str(used))
    assert gpu_free_bytes([0, 1], drm=str(tmp_path)) == {0: 200, 1: 500}
    assert gpu_free_bytes([0], drm=str(tmp_path / "none")) is None
