"""Where an engine's ranks run: the GPUs the supervisor hands each replica of an entry of tp N,
and the device each rank names in /server_info (the machine's GPU numbers)."""

from __future__ import annotations

from actors.engine_rank import device_names
from actors.supervisor import Supervisor
from glmrt.topology import ActorSpec


def test_each_replica_gets_its_tp_gpus_in_turn():
    spec = ActorSpec("engine", replicas=2, tp=2, gpus=(4, 5, 6, 7))
    assert [Supervisor._gpus(None, spec, r) for r in range(2)] == [[4, 5], [6, 7]]
    scaled_down = ActorSpec("engine", replicas=1, tp=2, gpus=(4, 5, 6, 7))   # then up again: same GPUs
    assert Supervisor._gpus(None, scaled_down, 1) == [6, 7]
    one_rank = ActorSpec("engine", replicas=3, gpus=(2,))
    assert [Supervisor._gpus(None, one_rank, r) for r in range(3)] == [[2], [2], [2]]
    assert Supervisor._gpus(None, ActorSpec("engine", tp=2), 0) == []


def test_ranks_name_the_machines_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")   # what the supervisor gave the engine's process
    assert device_names(2, [0, 1]) == ["cuda:6", "cuda:7"]
    assert device_names(2, []) == ["cpu", "cpu"]
