"""The supervisor's status while it starts an actor's process again: the row says "restarting"
with the dead process's pid until the new process exists, then "starting" with the new pid;
never "starting" with the old one (a client waiting for "starting" would read a pid that is
about to change)."""

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


@pytest.mark.asyncio
async def test_a_restarting_row_changes_state_and_pid_together(tmp_path, monkeypatch):
    topo = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine"}, {"kind": "detokenizer"}]})
    sup = Supervisor(topo, str(tmp_path), "/models/m", vocab_size=512)
    seen: list[tuple] = []

    def row() -> tuple:
        (r,) = [r for r in sup.status() if r["kind"] == "engine"]
        return r["pid"], r["state"]

    async def spawn(*args, **kwargs):  # the status a client reads while the process is being created
        seen.append(row())
        await asyncio.sleep(0)
        seen.append(row())
        return _Proc(222)

    monkeypatch.setattr(sup_mod.asyncio, "create_subprocess_exec", spawn)
    try:
        ap = ActorProc("engine", 0, [], proc=_Proc(111), state="restarting", ever_ready=True)
        sup.actors[ap.actor_id] = ap
        await sup._spawn_group([(topo.actor("engine"), 0)], [ap])
        assert seen == [(111, "restarting"), (111, "restarting")]
        assert row() == (222, "starting") and ap.ever_ready is False
    finally:
        for t in sup._tasks:
            t.cancel()
        sup.inbox.close()
        sup.peers.close()
