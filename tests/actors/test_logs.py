"""The lines glmrt prints while serving (actors/logs.py): the one format, a finished request's
line, and an engine's stats line that is due every interval and silent while the engine idles."""

from __future__ import annotations

import re
import subprocess
import sys

from actors.logs import EngineStatsLog, request_line
from glmrt import protocol as P
from tests.e2e.conftest import REPO


def _stats(prompt=0.0, cached=0.0, generated=0.0, running=0, waiting=0) -> P.EngineStats:
    return P.EngineStats(actor="engine", replica=0, kv_pages_total=100, kv_pages_free=70, state_slots_total=8,
                         state_slots_free=6, running=running, waiting=waiting,
                         counters={"page_size": 16, "cached_pages": 10, "checkpoint_pages": 0, "slots_checkpoint": 1,
                                   "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                                   "generation_tokens": generated})


def test_stats_line_every_interval_while_working():
    log = EngineStatsLog(2.0, now=0.0)
    assert not log.due(1.9) and log.due(2.0)
    line = log.line(_stats(prompt=400, cached=100, generated=50, running=2, waiting=1), now=2.0)
    assert line == ("running 2, queued 1, KV pool 20.0% (320 tokens, 160 cached), state slots 12.5%, "
                    "gen 25.0 tok/s, prompt 200.0 tok/s, cache hit rate 25.0%")
    assert not log.due(3.9) and log.due(4.0)
    line = log.line(_stats(prompt=400, cached=100, generated=90, running=1), now=4.0)
    assert "running 1, queued 0" in line and "gen 20.0 tok/s, prompt 0.0 tok/s, cache hit rate 0.0%" in line


def test_stats_line_of_a_speculating_engine_adds_the_accepted_length():
    log = EngineStatsLog(1.0, now=0.0)
    s = _stats(generated=40, running=1)
    s.counters.update(spec_cycles=10, spec_emitted_tokens=35)
    assert log.line(s, now=1.0).endswith("cache hit rate 0.0%, accept len 3.50")
    s.counters.update(generation_tokens=44, spec_cycles=14, spec_emitted_tokens=39)
    assert log.line(s, now=2.0).endswith(", accept len 1.00")   # since the last line


def test_no_stats_line_while_idle_nor_with_interval_zero():
    log = EngineStatsLog(1.0, now=0.0)
    assert log.line(_stats(prompt=10, generated=5), now=1.0) is not None
    assert log.line(_stats(prompt=10, generated=5), now=2.0) is None   # nothing new, nothing held
    assert log.line(_stats(prompt=10, generated=5, waiting=1), now=3.0) is not None   # a request still waits
    off = EngineStatsLog(0.0, now=0.0)
    assert not off.due(0.0) and not off.due(1e9)


def test_request_line_of_a_served_and_a_failed_request():
    usage = {"prompt_tokens": 21, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 16}}
    assert request_line("chatcmpl-1", status=200, duration=0.25, ttft=0.0124, usage=usage,
                        finish=["stop", "length"]) == (
        "request chatcmpl-1: status=200 prompt_tokens=21 cached_tokens=16 output_tokens=8 ttft=0.012s "
        "duration=0.250s finish=stop,length")
    assert request_line("cmpl-2", status=503, duration=0.5, error="actor_failed") == (
        "request cmpl-2: status=503 duration=0.500s error=actor_failed")


def test_one_format_for_every_process():
    probe = ("import logging\nfrom actors.logs import configure_logging\nconfigure_logging('warning')\n"
             "logging.getLogger('engine/0').info('hidden')\nlogging.getLogger('engine/0').warning('shown')\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=str(REPO), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d WARNING engine/0: shown\n", r.stdout), r.stdout
