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

Ranks on several nodes (glmrt.nodes): rank 0 starts only the ranks of its own node; each other
node's `glmrt up` starts its share (`RankGroup` with `ranks`, not watched by a rank 0). They meet
at the TCP store of --dist-init-addr, and the step inputs and the liveness pings go on the CURVE
link of transport/node_link.py: a rank that loses rank 0, or a rank 0 that loses a rank, exits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec

from actors.logs import configure_logging
from actors.worker import die_with_parent
from glmrt.engine.config import EngineConfig

# What a node may set for itself; every other engine setting must be the same on every node.
NODE_LOCAL_FIELDS = ("model", "device")
SETTINGS_KEY = "glmrt-ranks/settings"  # rank 0's, in the store: the others check theirs against it
REFUSED = 2  # the exit status of a rank whose settings are not rank 0's
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
    nnodes: int = 1
    """Nodes the group spans: > 1, the step inputs come on the CURVE link (transport/node_link.py)."""
    curve_key_file: str | None = None
    node_rank: int = 0


def group_settings(engine: EngineConfig, tp: int, ep: int, key_file: str | None) -> dict:
    """What every rank of a group over nodes must agree on (its node's `glmrt up` built it from the
    same topology and flags), as JSON values: the engine settings, and the link's public key when
    it comes from a key file (a rank with another key would only be refused by the link later)."""
    values = {k: v for k, v in dataclasses.asdict(engine).items() if k not in NODE_LOCAL_FIELDS}
    key = None
    if key_file:
        from transport.node_link import load_key_file
        key = load_key_file(key_file)[0].decode()
    return json.loads(json.dumps({"tp": tp, "ep": ep, **values, "curve_key_file public key": key}))


def settings_refusal(rank: int, ours: dict, rank0: dict) -> str | None:
    """Why rank `rank`, built with settings `ours`, cannot join the group of a rank 0 built with
    `rank0`, or None."""
    diff = [k for k in rank0 if ours.get(k) != rank0[k]]
    if not diff:
        return None
    named = ", ".join(f"{k} {ours.get(k)!r} (rank 0: {rank0[k]!r})" for k in diff[:4])
    return (f"rank {rank} runs other engine settings than rank 0: {named}; every node must run glmrt up with "
            "the same topology and flags")


def device_names(tp_size: int, gpus: list[int]) -> list[str]:
    """Each rank's device as the machine numbers it ("cuda:3"), or "cpu": rank r runs on the
    r-th of the engine's GPUs (`gpus`: indices into this process's CUDA_VISIBLE_DEVICES)."""
    if not gpus:
        return ["cpu"] * tp_size
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = [visible[g] if g < len(visible) else str(g) for g in gpus]
    return [f"cuda:{p}" for p in physical[:tp_size]]


class RankGroup:
    """Rank 0's handle on ranks 1..N-1 (those of its node), or a node's on its share of the
    ranks (`ranks`, `watch=False`: that node's `glmrt up` watches them): their processes."""

    def __init__(self, actor_id: str, tp_size: int, ep_size: int, rendezvous: str, engine: EngineConfig,
                 gpus: list[int], log_level: str, torch_threads: int, log: logging.Logger, *,
                 ranks: range | None = None, watch: bool = True, nnodes: int = 1, node_rank: int = 0,
                 curve_key_file: str | None = None):
        ranks = range(1, tp_size) if ranks is None else ranks
        first = ranks.start if node_rank > 0 else 0  # the node's first rank: on its first device
        self.devices = device_names(ranks.stop - first, gpus)
        self.first = first
        self.log = log
        self.stopping = False
        self.remote: list[dict] = []  # rank 0 of a group over nodes: the other nodes' ranks, once joined
        self.link = None
        self.procs: list[subprocess.Popen] = []
        self.rank_ids = list(ranks)
        if engine.device.startswith("cuda:"):  # each rank sees its one GPU only, as cuda:0
            engine = engine.replace(device="cuda")
        for rank in ranks:
            spec = RankSpec(actor_id=actor_id, rank=rank, tp_size=tp_size, ep_size=ep_size, rendezvous=rendezvous,
                            engine=engine, parent_pid=os.getpid(), log_level=log_level, torch_threads=torch_threads,
                            nnodes=nnodes, curve_key_file=curve_key_file, node_rank=node_rank)
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(torch_threads))
            if gpus:  # one GPU per rank: it is cuda:0 in the rank's own process
                env["CUDA_VISIBLE_DEVICES"] = self.devices[rank - first].removeprefix("cuda:")
            # started from the main thread: PR_SET_PDEATHSIG fires when the starting thread ends
            self.procs.append(subprocess.Popen([sys.executable, "-m", "actors.engine_rank",
                                                msgspec.json.encode(spec).decode()], env=env))
        if watch:
            for rank, proc in zip(self.rank_ids, self.procs):
                threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                                 name=f"rank-{rank}-watch").start()

    @classmethod
    def start(cls, spec, log: logging.Logger):
        """Rank 0's engine actor (`spec`: its RunSpec) starts ranks 1..tp-1 from its main thread
        -> (the group, a callable that joins the group and builds rank 0's Engine: run it in the
        step thread)."""
        import torch

        from glmrt.engine.engine import Engine
        from glmrt.engine.ranks import join_group, rendezvous_path

        c = spec.config
        if c.nnodes > 1:
            from glmrt.nodes import node_ranks, split_addr, tcp_url
            from transport.node_link import LinkServer
            host, port = split_addr(c.dist_init_addr)
            rendezvous = tcp_url(host, port)
            local = node_ranks(c.tp, c.nnodes, 0)
            group = cls(spec.actor_id, c.tp, c.ep, rendezvous, c.engine, spec.gpus, spec.log.level,
                        c.torch_threads, log, ranks=range(1, local.stop), nnodes=c.nnodes,
                        curve_key_file=c.curve_key_file)

            def wire(store):  # the link binds on node 0's named address only
                group.link = LinkServer(store, tcp_url(host, "*"), c.tp, c.curve_key_file,
                                        on_lost=group.lost, log=log)
                group.remote = [{"rank": r, **{k: info[k] for k in ("pid", "device", "host", "node")}}
                                for r, info in sorted(group.link.peers.items()) if r >= local.stop]
                return group.link

            def meet(store):  # before the group forms: the others check their settings against these
                store.set(SETTINGS_KEY, json.dumps(group_settings(c.engine, c.tp, c.ep, c.curve_key_file)))
        else:
            wire = meet = None
            rendezvous = rendezvous_path(spec.run_dir, spec.actor_id)
            group = cls(spec.actor_id, c.tp, c.ep, rendezvous, c.engine, spec.gpus, spec.log.level, c.torch_threads,
                        log)
        log.info("tp %d, ep %d: ranks %s%s", c.tp, c.ep,
                 ", ".join(f"{r['rank']} (pid {r['pid']}, {r['device']})" for r in group.ranks()),
                 f"; ranks {c.tp // c.nnodes}..{c.tp - 1} on the other {c.nnodes - 1} node(s), at {rendezvous}"
                 if c.nnodes > 1 else "")

        def build():
            device = c.engine.resolved_device()
            if device.startswith("cuda"):
                torch.cuda.set_device(spec.gpus[0] if spec.gpus else 0)  # the step thread's own current device
            parallel, link = join_group(0, c.tp, c.ep, rendezvous, device, wire=wire, meet=meet)
            return Engine(c.engine, log=log.info, parallel=parallel, link=link)
        return group, build

    def lost(self, why: str) -> None:
        """The link lost a rank of another node: end the engine, as `_watch` does for a local one."""
        self.log.error("%s; the engine stops", why)
        self.kill()
        os._exit(1)

    def stop(self, engine) -> None:
        """Step thread, as the engine ends: the other ranks leave their loop and exit."""
        try:
            engine.runner.stop_followers()
        finally:
            # the ranks wait for rank 0 in leave_group's barrier before they exit: meet them
            # there first, then wait for their processes (the other order waits out the barrier)
            from glmrt.engine.ranks import leave_group
            leave_group()
            self.wait_stopped()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        if not self.stopping:
            # the others would wait in a collective for it forever: end the whole engine, so
            # the supervisor sees it fail (and restarts the group when it was serving)
            self.log.error("rank %d (pid %d) exited with status %s; the engine stops", rank, proc.pid, rc)
            self.kill()
            os._exit(1)

    def ranks(self) -> list[dict]:
        """Every rank's pid and device, rank 0 first (ranks of other nodes: once they joined)."""
        pids = ([os.getpid()] if self.first == 0 else []) + [p.pid for p in self.procs]
        ids = ([0] if self.first == 0 else []) + self.rank_ids
        local = [{"rank": r, "pid": pid, "device": self.devices[r - self.first]} for r, pid in zip(ids, pids)]
        return local + self.remote

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
    if spec.nnodes > 1:
        from transport.node_link import LinkClient
        name = f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}" if device.startswith("cuda") else "cpu"
        info = {"pid": os.getpid(), "device": name, "host": socket.gethostname(), "node": spec.node_rank}

        def lost(why: str) -> None:  # rank 0 is gone: its collectives will never come
            log.error("%s; rank %d exits", why, spec.rank)
            os._exit(1)

        def wire(store):
            return LinkClient(store, spec.rank, spec.curve_key_file, info, on_lost=lost, log=log)

        def meet(store):  # a rank built from other flags would compute garbage with the others
            ours = group_settings(spec.engine, spec.tp_size, spec.ep_size, spec.curve_key_file)
            refusal = settings_refusal(spec.rank, ours, json.loads(bytes(store.get(SETTINGS_KEY))))
            if refusal:
                log.error("%s", refusal)
                os._exit(REFUSED)
    else:
        wire = meet = None
    parallel, link = join_group(spec.rank, spec.tp_size, spec.ep_size, spec.rendezvous, device, wire=wire,
                                meet=meet)
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
