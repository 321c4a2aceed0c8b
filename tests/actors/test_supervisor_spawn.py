"""The supervisor's status while it starts an actor's process again: the row says "restarting"
with the dead process's pid until the new process exists, then "starting" with the new pid;
never "starting" with the old one (a client waiting for "starting" would read a pid that is
about to change). A Ready that comes in while the process is being created is kept."""

from __future__ import annotations

import asyncio

import pytest

from actors import supervisor as sup_mod
from actors.supervisor import ActorProc, Supervisor
from glmrt.topology import parse_topology


class _Proc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._done = asyncio.Event()

    async def wait(self) -> int:
        await self._done.wait()
        return 0


@pytest.fixture
def sup(tmp_path):
    topo = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine"}, {"kind": "detokenizer"}]})
    s = Supervisor(topo, str(tmp_path), "/models/m", vocab_size=512)
    yield s
    for t in s._tasks:
        t.cancel()
    s.inbox.close()
    s.peers.close()


def _row(sup) -> tuple:
    (r,) = [r for r in sup.status() if r["kind"] == "engine"]
    return r["pid"], r["state"]


@pytest.mark.asyncio
async def test_a_restarting_row_changes_state_and_pid_together(sup, monkeypatch):
    seen: list[tuple] = []

    async def spawn(*args, **kwargs):  # the status a client reads while the process is being created
        seen.append(_row(sup))
        await asyncio.sleep(0)
        seen.append(_row(sup))
        return _Proc(222)

    monkeypatch.setattr(sup_mod.asyncio, "create_subprocess_exec", spawn)
    ap = sup.actors["engine/0"] = ActorProc("engine", 0, [], proc=_Proc(111), state="restarting", ever_ready=True)
    await sup._spawn_group([(sup.topo.actor("engine"), 0)], [ap])
    assert seen == [(111, "restarting"), (111, "restarting")]
    assert _row(sup) == (222, "starting") and ap.ever_ready is False


@pytest.mark.asyncio
async def test_a_ready_that_came_during_the_spawn_is_kept(sup, monkeypatch):
    ap = sup.actors["engine/0"] = ActorProc("engine", 0, [], proc=_Proc(111), state="restarting", ever_ready=True)

    async def spawn(*args, **kwargs):  # the new process's Ready handled before this await returns
        ap.state, ap.ever_ready = "ready", True
        return _Proc(222)

    monkeypatch.setattr(sup_mod.asyncio, "create_subprocess_exec", spawn)
    await sup._spawn_group([(sup.topo.actor("engine"), 0)], [ap])
    assert _row(sup) == (222, "ready") and ap.ever_ready is True


@pytest.mark.asyncio
async def test_status_counts_every_restart_not_only_those_of_the_give_up_window(sup, monkeypatch):
    pids = iter(range(300, 310))

    async def spawn(*args, **kwargs):
        return _Proc(next(pids))

    monkeypatch.setattr(sup_mod.asyncio, "create_subprocess_exec", spawn)
    monkeypatch.setattr(sup_mod, "RESTART_WINDOW_S", 0.0)  # every earlier restart is out of the window
    spec = sup.topo.actor("engine")
    (ap,) = await sup._spawn_group([(spec, 0)])
    for n in (1, 2, 3):
        ap.state, ap.ever_ready = "ready", True
        ap.proc._done.set()  # the process exits: the watcher restarts it
        old = ap.proc
        while ap.proc is old:
            await asyncio.sleep(0.01)
        assert _row(sup) == (ap.proc.pid, "starting")
        assert sup.status()[0]["restarts"] == n and len(ap.restarts) == 1
