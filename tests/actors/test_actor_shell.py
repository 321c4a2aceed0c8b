"""The actor shell: a loop of an actor that dies ends its process, instead of leaving an actor whose
heartbeat says alive while the requests it holds wait forever (the supervisor restarts it)."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import zmq.asyncio

from actors.base import Actor
from glmrt.actor_config import DetokenizerActorConfig
from tests.actors.conftest import run_spec


class _DiesInItsLoop(Actor):
    kind = "detokenizer"

    async def background(self) -> None:
        await asyncio.sleep(0.05)
        raise ValueError("boom")


class _Quiet(Actor):
    kind = "detokenizer"


@pytest.mark.timeout(30)
async def test_an_actor_whose_loop_fails_raises_out_of_run():
    run_dir = tempfile.mkdtemp(prefix="glmrt-t")   # short: ipc paths are capped
    ctx = zmq.asyncio.Context()
    actor = _DiesInItsLoop(run_spec("detokenizer", run_dir, DetokenizerActorConfig(model_path=run_dir)), ctx)
    try:
        with pytest.raises(RuntimeError, match=r"^detokenizer/0: .*background failed$") as e:
            await asyncio.wait_for(actor.run(), 10)
        assert isinstance(e.value.__cause__, ValueError)
    finally:
        actor.inbox.close()
        actor.peers.close()
        ctx.term()


@pytest.mark.timeout(30)
async def test_a_shutdown_still_ends_run_normally():
    run_dir = tempfile.mkdtemp(prefix="glmrt-t")
    ctx = zmq.asyncio.Context()
    actor = _Quiet(run_spec("detokenizer", run_dir, DetokenizerActorConfig(model_path=run_dir)), ctx)
    task = asyncio.create_task(actor.run())
    await asyncio.sleep(0.2)
    actor._stop.set()
    await asyncio.wait_for(task, 10)
    ctx.term()
