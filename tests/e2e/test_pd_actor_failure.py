"""E2E: the detokenizer of a prefill/decode deployment killed mid-stream. The decode (or, before
the handoff, the prefill) holds each request's DetokenizeRequest and tokens, replays them to the
restarted detokenizer, and every stream and answer equals an undisturbed greedy run."""

from __future__ import annotations

import pytest

from tests.e2e.test_actor_failure import _requests, kill_detokenizer_mid_stream
from tests.e2e.test_pd import topology

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_pd_detokenizer_kill_loses_no_request(start_deployment, tmp_path):
    dep = start_deployment([topology(tmp_path, "pd-detok")], name="pd-detok")
    try:
        kill_detokenizer_mid_stream(dep, _requests("pd", 12))
    finally:
        dep.stop(term_wait=5)
