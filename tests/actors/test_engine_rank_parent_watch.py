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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(30)
def test_a_rank_exits_soon_after_its_parent_dies():
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, RANK], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=REPO))
    rank = int(middle.stdout.readline())
    try:
        time.sleep(1.0)
        assert _alive(rank)
        t_kill = time.monotonic()
        middle.send_signal(signal.SIGKILL)
        middle.wait()
        while _alive(rank):
            assert time.monotonic() - t_kill < 2.0, "the rank outlived its parent by 2 s"
            time.sleep(0.02)
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
