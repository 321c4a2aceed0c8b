"""The ranks of an engine of several: rank 0 (the engine actor) starts ranks 1..N-1 as
processes of this module (`python -m actors.engine_rank '<RankSpec JSON>'`), each on its own GPU
(or all on the CPU), and watches them.

A rank joins its engine's torch.distributed group at a rendezvous file in the deployment's 0700
run dir, builds its ModelRank (its shard of the model, its pools, its decode graphs) and runs
the steps rank 0 publishes until rank 0 says stop. It dies with rank 0 (PR_SET_PDEATHSIG, and
a watcher thread that exits once it is re-parented; a rank whose parent is already gone exits
at once); rank 0 exits when one of its ranks dies (a watcher thread per rank: a collective
blocked on a dead peer cannot be interrupted, so the process ends instead), so the supervisor
sees one engine fail, fails the requests it held at once and restarts the whole group. Both
directions take well under a second (tests/e2e/test_engine_group_failure.py bounds them at 5 s).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from actors.logs import configure_logging
from actors.worker import die_with_parent
from glmrt.engine.config import EngineConfig

STOP_WAIT_S = 5.0  # a rank told to stop that has not exited by then is killed
PARENT_POLL_S = 0.25  # how often a rank checks that rank 0 is still its parent


class RankSpec(msgspec.Struct):
    """What rank 0 hands each of its other ranks."""

    actor_id: str
    rank: int
    tp_size: int
    ep_size: int
    rendezvous: str
    engine: EngineConfig
    parent_pid: int
    log_level: str = "info"
    torch_threads: int = 1


def device_names(tp_size: int, gpus: list[int]) -> list[str]:
    """Each rank's device as the machine numbers it ("cuda:3"), or "cpu": rank r runs on the
    r-th of the engine's GPUs (`gpus`: indices into this process's CUDA_VISIBLE_DEVICES)."""
    if not gpus:
        return ["cpu"] * tp_size
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = [visible[g] if g < len(visible) else str(g) for g in gpus]
    return [f"cuda:{p}" for p in physical[:tp_size]]


class RankGroup:
    """Rank 0's handle on ranks 1..N-1: their processes, started and watched."""

    def __init__(self, actor_id: str, tp_size: int, ep_size: int, rendezvous: str, engine: EngineConfig,
                 gpus: list[int], log_level: str, torch_threads: int, log: logging.Logger):
        self.devices = device_names(tp_size, gpus)
        self.log = log
        self.stopping = False
        self.procs: list[subprocess.Popen] = []
        if engine.device.startswith("cuda:"):  # each rank sees its one GPU only, as cuda:0
            engine = engine.replace(device="cuda")
        for rank in range(1, tp_size):
            spec = RankSpec(actor_id=actor_id, rank=rank, tp_size=tp_size, ep_size=ep_size, rendezvous=rendezvous,
                            engine=engine, parent_pid=os.getpid(), log_level=log_level, torch_threads=torch_threads)
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch_threads))
            if gpus:  # one GPU per rank: it is cuda:0 in the rank's own process
                env["CUDA_VISIBLE_DEVICES"] = self.devices[rank].removeprefix("cuda:")
            # started from the main thread: PR_SET_PDEATHSIG fires when the starting thread ends
            self.procs.append(subprocess.Popen([sys.executable, "-m", "actors.engine_rank",
                                                msgspec.json.encode(spec).decode()], env=env))
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"rank-{rank}-watch").start()

    @classmethod
    def start(cls, spec, log: logging.Logger):
        """Rank 0's engine actor (`spec`: its RunSpec) starts ranks 1..tp-1 from its main thread
        -> (the group, a callable that joins the group and builds rank 0's Engine: run it in the
        step thread)."""
        import torch

        from glmrt.engine.engine import Engine
        from glmrt.engine.ranks import join_group, rendezvous_path

        c = spec.config
        rendezvous = rendezvous_path(spec.run_dir, spec.actor_id)
        group = cls(spec.actor_id, c.tp, c.ep, rendezvous, c.engine, spec.gpus, spec.log.level, c.torch_threads, log)
        log.info("tp %d, ep %d: ranks %s", c.tp, c.ep,
                 ", ".join(f"{r['rank']} (pid {r['pid']}, {r['device']})" for r in group.ranks()))

        def build():
            device = c.engine.resolved_device()
            if device.startswith("cuda"):
                torch.cuda.set_device(spec.gpus[0] if spec.gpus else 0)  # the step thread's own current device
            parallel, link = join_group(0, c.tp, c.ep, rendezvous, device)
            return Engine(c.engine, log=log.info, parallel=parallel, link=link)
        return group, build

    def stop(self, engine) -> None:
        """Step thread, as the engine ends: the other ranks leave their loop and exit."""
        try:
            engine.runner.stop_followers()
        finally:
            self.wait_stopped()
            from glmrt.engine.ranks import leave_group
            leave_group()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        if not self.stopping:
            # the others would wait in a collective for it forever: end the whole engine, so
            # the supervisor sees it fail (and restarts the group when it was serving)
            self.log.error("rank %d (pid %d) exited with status %s; the engine stops", rank, proc.pid, rc)
            self.kill()
            os._exit(1)

    def ranks(self) -> list[dict]:
        """Every rank's pid and device, rank 0 first."""
        pids = [os.getpid()] + [p.pid for p in self.procs]
        return [{"rank": r, "pid": pid, "device": dev} for r, (pid, dev) in enumerate(zip(pids, self.devices))]

    def wait_stopped(self, timeout: float = STOP_WAIT_S) -> None:
        """After rank 0 told them to stop: wait for the ranks, killing those that linger."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def watch_parent(parent_pid: int) -> None:
    """A second guard beside PR_SET_PDEATHSIG (absent where prctl is not available): once rank 0
    is gone (this process is re-parented) the rank exits, even while its main thread waits in a
    collective that would otherwise block until the group's timeout."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    spec = msgspec.json.decode(argv[0], type=RankSpec)
    if os.getppid() != spec.parent_pid:  # rank 0 died before the death signal was set up
        return 1
    watch_parent(spec.parent_pid)
    configure_logging(spec.log_level)
    log = logging.getLogger(f"{spec.actor_id}.rank{spec.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop

    import torch

    from glmrt.engine.model_rank import ModelRank
    from glmrt.engine.ranks import join_group, leave_group

    torch.set_num_threads(spec.torch_threads)
    device = spec.engine.resolved_device()
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    parallel, link = join_group(spec.rank, spec.tp_size, spec.ep_size, spec.rendezvous, device)
    rank = ModelRank(spec.engine, log=log.debug, parallel=parallel, link=link)
    transfers = None
    if spec.engine.role != "unified":  # a PD engine: this rank writes (or receives) its own share
        from actors.engine_handoff import HANDOFF_TIMEOUT_S
        from actors.rank_handoff import RankTransfers
        transfers = rank.runner.rank_transfers = RankTransfers(spec.actor_id, spec.rank, rank, HANDOFF_TIMEOUT_S)
    log.info("rank %d of %d ready on %s", spec.rank, spec.tp_size, device)
    try:
        rank.follow()
    finally:
        if transfers is not None:
            transfers.close()
    leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
