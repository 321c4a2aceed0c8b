"""bench.timing on the CPU: host_time's clocks and costliest functions, as_engine_threads."""

from __future__ import annotations

import time

import torch

from bench.timing import as_engine_threads, host_time


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(500):  # the time in this function's own frame, not in the clock's
            pass


def _step() -> None:
    _spin(20)
    sum(range(1000))


def test_host_time_reports_the_step_and_its_costliest_function():
    got = host_time(_step, n=3, top=3)
    assert 19 <= got["host_ms"] <= got["wall_ms"]
    own, cum, calls, where = got["top"][0]
    assert where.endswith(" _spin") and "test_timing.py:" in where and own >= 15 and calls == 1, got["top"]
    assert len(got["top"]) == 3


def test_host_time_without_top_profiles_nothing():
    got = host_time(_step, n=1)
    assert got["top"] == [] and got["host_ms"] >= 19


def test_as_engine_threads_takes_the_engine_actors_thread_count():
    from glmrt.actor_config import EngineActorConfig

    keep = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert as_engine_threads() == EngineActorConfig.torch_threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(keep)
