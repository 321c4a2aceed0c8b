"""bench.timing.host_time on the CPU: host and wall clocks, and where the host time went."""

from __future__ import annotations

import time

from bench.timing import host_time


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
    name, ms = got["top"][0]
    assert name.startswith("_spin (test_timing.py:") and ms >= 15, got["top"]
    assert len(got["top"]) == 3


def test_host_time_without_top_profiles_nothing():
    got = host_time(_step, n=1)
    assert got["top"] == [] and got["host_ms"] >= 19
