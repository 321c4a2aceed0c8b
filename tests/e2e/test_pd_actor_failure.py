"""E2E: the detokenizer of a prefill/decode deployment killed mid-stream. The decode (or, before
the handoff, the prefill) holds each request's DetokenizeRequest and tokens, replays them to the
restarted detokenizer, and every stream and answer equals an undisturbed greedy run."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.test_actor_failure import (_assert_undisturbed, _first_chunks_seen, _load, _pid, _requests,
                                          _wait_healthy_again)
from tests.e2e.test_pd import topology

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_pd_detokenizer_kill_loses_no_request(start_deployment, tmp_path):
    dep = start_deployment([topology(tmp_path, "pd-detok")], name="pd-detok")
    try:
        requests = _requests("pd", 12)
        want = _load(dep, requests)
        old_pid = _pid(dep, "detokenizer")

        def kill_mid_stream():
            _first_chunks_seen(dep, "detokenizer")
            os.kill(old_pid, signal.SIGKILL)
        _assert_undisturbed(_load(dep, requests, kill_mid_stream), want, "detokenizer/0")
        _wait_healthy_again(dep, old_pid, "detokenizer")
    finally:
        dep.stop(term_wait=5)
