"""A rank 1..N-1 exits once rank 0 is gone, by its parent watch alone (no PR_SET_PDEATHSIG here):
its main thread may wait in a collective that would block until the group's timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.e2e.conftest import process_alive

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the middle process (rank 0's stand-in) starts the rank, prints its pid and waits to be killed
MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(rank.pid, flush=True)
    time.sleep(600)
""")
RANK = textwrap.dedent("""
    import os, threading
    from actors.engine_rank import watch_parent
    watch_parent(os.getppid())
    threading.Event().wait()   # a main thread blocked for good, as in a collective on a dead peer
""")


@pytest.mark.timeout(30)
def test_a_rank_exits_soon_after_its_parent_dies():
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, RANK], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=REPO))
    rank = int(middle.stdout.readline())
    try:
        time.sleep(1.0)
        assert process_alive(rank)
        t_kill = time.monotonic()
        middle.send_signal(signal.SIGKILL)
        middle.wait()
        while process_alive(rank):
            assert time.monotonic() - t_kill < 2.0, "the rank outlived its parent by 2 s"
            time.sleep(0.02)
    finally:
        if process_alive(rank):
            os.kill(rank, signal.SIGKILL)
