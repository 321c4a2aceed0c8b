"""The supervisor: spawns actor processes per the topology, watches them, scales them.

It runs in the `glmrt up` process beside the api actor. Each actor replica is one process
(`python -m actors.worker`), found by its address id ("engine/1"); the supervisor's inbox
gets every Ready, Heartbeat and Drained. An actor that dies unexpectedly is reported to the
api (`on_failure`: it fails the requests an engine held, and recovers those at a tokenizer or
a detokenizer) and restarted; its first Ready after a restart is reported too
(`on_restarted`). `scale` adds replicas or retires the highest ones with a drain, so no
in-flight request is lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq.asyncio

from actors.base import RunSpec, codec_for, encode_run_specs, inbox_address
from glmrt import protocol as P
from glmrt.actor_config import (ActorConfig, ActorLogConfig, DetokenizerActorConfig, EngineActorConfig,
                                MediaPolicy, TokenizerActorConfig, VisionActorConfig)
from glmrt.actor_kinds import kind_of
from glmrt.topology import ActorSpec, Topology
from glmrt.topology_checks import validate_scale
from transport.channels import Inbox, Peers

log = logging.getLogger("supervisor/0")
MAX_RESTARTS = 5           # within RESTART_WINDOW_S, then the actor is marked failed
RESTART_WINDOW_S = 60.0


@dataclass
class ActorProc:
    kind: str
    replica: int
    gpus: list[int]
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"       # starting | ready | retiring | retired | restarting | failed
    load: float = 0.0
    running: int = 0
    waiting: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)  # times within RESTART_WINDOW_S (the give-up rule)
    restart_count: int = 0  # since the deployment started (what status reports)
    last_heartbeat: float = 0.0
    ever_ready: bool = False

    @property
    def actor_id(self) -> str:
        return f"{self.kind}/{self.replica}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class Supervisor:
    def __init__(self, topology: Topology, run_dir: str, model_path: str, *, vocab_size: int,
                 on_failure: Callable[[str], None] | None = None,
                 on_restarted: Callable[[str], None] | None = None):
        self.topo = topology
        self.run_dir = run_dir
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.on_failure = on_failure or (lambda actor_id: None)
        self.on_restarted = on_restarted or (lambda actor_id: None)
        self.ctx = zmq.asyncio.Context.instance()
        self.inbox = Inbox(self.ctx, inbox_address(run_dir, "supervisor/0"), codec_for("supervisor/0"))
        self.peers = Peers(self.ctx, lambda pid: (inbox_address(run_dir, pid), codec_for(pid)))
        self.actors: dict[str, ActorProc] = {}
        self.stopping = False
        self._tasks: list[asyncio.Task] = []

    # ---- queries -------------------------------------------------------------------------
    def ready(self, kind: str) -> list[ActorProc]:
        return [a for a in self.actors.values() if a.kind == kind and a.state == "ready"]

    def all_ready(self) -> bool:
        live = [a for a in self.actors.values() if a.state not in ("retired",)]
        return bool(live) and all(a.state in ("ready", "retiring") for a in live) and \
            all(self.ready(spec.kind) for spec in self.topo.actors)   # validate(): every required kind is placed

    def status(self) -> list[dict[str, Any]]:
        import socket
        out = []
        for a in sorted(self.actors.values(), key=lambda x: (x.kind, x.replica)):
            if a.state == "retired":
                continue
            row = {"kind": a.kind, "replica": a.replica, "pid": a.pid, "host": socket.gethostname(), "gpus": a.gpus,
                   "state": a.state, "load": round(a.load, 4), "running": a.running, "waiting": a.waiting,
                   "restarts": a.restart_count}
            if kind_of(a.kind).engine_role is not None:  # its ranks, once its Ready said where they run
                row.update(tp=a.info.get("tp_size"), ep=a.info.get("ep_size"), ranks=a.info.get("ranks", []))
            out.append(row)
        return out

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._recv_loop()))
        groups: dict[str, list[tuple[ActorSpec, int]]] = {}
        for spec in self.topo.actors:
            for r in range(spec.replicas):
                if spec.process:
                    groups.setdefault(spec.process, []).append((spec, r))
                else:
                    await self._spawn(spec, r)
        for members in groups.values():
            await self._spawn_group(members)

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.all_ready():
                return True
            if any(a.state == "failed" for a in self.actors.values()):
                return False
            await asyncio.sleep(0.05)
        return False

    def _gpus(self, spec: ActorSpec, replica: int) -> list[int]:
        if not spec.gpus:
            return []
        if spec.tp > 1 or len(spec.gpus) == spec.replicas:  # replica i: its tp GPUs of the list, in turn
            return list(spec.gpus[replica * spec.tp:(replica + 1) * spec.tp])
        return [spec.gpus[replica % len(spec.gpus)]]

    def _config(self, spec: ActorSpec) -> ActorConfig:
        """The typed config section of one actor of `spec`, from the validated topology."""
        if kind_of(spec.kind).engine_role is not None:
            return engine_actor_config(self.topo, spec, self.model_path)
        if spec.kind == "vision":
            engines = self.topo.prompt_engines()   # prefill and decode agree on dtype (validate)
            dtype = self.topo.engine_config(engines[0]).dtype if engines else self.topo.model.dtype
            return VisionActorConfig(model_path=self.model_path, dtype=dtype,
                                     feature_transport=self.topo.feature_transport)
        if spec.kind == "detokenizer":
            return DetokenizerActorConfig(model_path=self.model_path)
        vision = self.topo.actor("vision")
        media = MediaPolicy(self.topo.api.allowed_local_media_path, self.topo.api.allow_remote_media)
        return TokenizerActorConfig(model_path=self.model_path, vocab_size=self.vocab_size, media=media,
                                    vision_replicas=vision.replicas if vision is not None else 0)

    def _run_spec(self, spec: ActorSpec, replica: int, gpus: list[int]) -> RunSpec:
        """What one actor process is handed for replica `replica` of `spec`."""
        return RunSpec(kind=spec.kind, replica=replica, run_dir=self.run_dir, config=self._config(spec), gpus=gpus,
                       log=ActorLogConfig(level=self.topo.log.log_level))

    async def _spawn(self, spec: ActorSpec, replica: int, existing: ActorProc | None = None) -> ActorProc:
        return (await self._spawn_group([(spec, replica)], [existing] if existing else None))[0]

    async def _spawn_group(self, members: list[tuple[ActorSpec, int]],
                           existing: list[ActorProc] | None = None) -> list[ActorProc]:
        """One process for `members` (several when topology entries share a `process` key)."""
        aps, runs = [], []
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        gpus_all: list[int] = []
        for i, (spec, replica) in enumerate(members):
            gpus = self._gpus(spec, replica)
            ap = existing[i] if existing else ActorProc(spec.kind, replica, gpus)
            ap.ever_ready = False
            self.actors[ap.actor_id] = ap
            aps.append(ap)
            gpus_all += [g for g in gpus if g not in gpus_all]
            runs.append(self._run_spec(spec, replica, gpus))
        if gpus_all:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus_all)
            for run in runs:
                run.gpus = [gpus_all.index(g) for g in run.gpus]
        elif not any(kind_of(spec.kind).uses_gpus for spec, _ in members):
            env["CUDA_VISIBLE_DEVICES"] = ""
        for run in runs:
            run.colocated = [r.actor_id for r in runs]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "actors.worker", encode_run_specs(runs),
                                                    env=env)
        for ap in aps:
            # a restart says "starting" only with its new process (status never pairs it with the
            # dead pid); the state is left alone when the new process's Ready, or a scale-down,
            # came in while the process was being created
            ap.proc = proc
            if ap.state == "restarting":
                ap.state = "starting"
        self._tasks.append(asyncio.create_task(self._watch(aps, members)))
        return aps

    async def _watch(self, aps: list[ActorProc], members: list[tuple[ActorSpec, int]]) -> None:
        proc = aps[0].proc
        rc = await proc.wait()
        if any(ap.proc is not proc for ap in aps):
            return
        if self.stopping or all(ap.state in ("retiring", "retired") for ap in aps):
            for ap in aps:
                ap.state = "retired"
            return
        names = ", ".join(ap.actor_id for ap in aps)
        if not all(ap.ever_ready for ap in aps):
            # A start that never reached Ready is a configuration or install error: restarting
            # would only repeat it. The actor's own output above says why.
            for ap in aps:
                ap.state = "failed"
            log.error("%s (pid %d) exited with status %s before it was ready", names, proc.pid, rc)
            for ap in aps:
                self.on_failure(ap.actor_id)
            return
        log.warning("%s (pid %d) exited with status %s; restarting", names, proc.pid, rc)
        now = time.monotonic()
        for ap in aps:
            ap.restarts = [t for t in ap.restarts if now - t < RESTART_WINDOW_S] + [now]
            ap.restart_count += 1
        give_up = len(aps[0].restarts) > MAX_RESTARTS
        for ap in aps:  # the state first: the api recovers requests only at an actor coming back
            ap.state = "failed" if give_up else "restarting"
            self.peers.forget(ap.actor_id)
            self.on_failure(ap.actor_id)
        if give_up:
            log.error("%s failed %d times in %.0f s; giving up", names, len(aps[0].restarts), RESTART_WINDOW_S)
            return
        await asyncio.sleep(min(0.2 * len(aps[0].restarts), 2.0))
        if not self.stopping:
            await self._spawn_group(members, aps)

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg, _ = await self.inbox.recv()
            except Exception as e:  # a bad frame must not stop supervision
                log.warning("dropped a message: %s", e)
                continue
            ap = self.actors.get(f"{getattr(msg, 'actor', '')}/{getattr(msg, 'replica', '')}")
            if ap is None:
                continue
            if isinstance(msg, P.Ready):
                ap.info = dict(msg.info)
                if ap.state in ("starting", "restarting"):
                    ap.state = "ready"
                    ap.ever_ready = True
                    log.info("%s ready (pid %d)", ap.actor_id, msg.pid)
                    if ap.restart_count:
                        self.on_restarted(ap.actor_id)
            elif isinstance(msg, P.Heartbeat):
                ap.load, ap.running, ap.waiting = msg.load, msg.running, msg.waiting
                ap.last_heartbeat = time.monotonic()
            elif isinstance(msg, P.Drained):
                if ap.state == "retiring" or self.stopping:
                    ap.state = "retired" if ap.state == "retiring" else ap.state

    # ---- scaling and shutdown ------------------------------------------------------------
    async def scale(self, kind: str, n: int, before_retire: Callable[[str], Any] | None = None) -> list[str]:
        """Set the replica count of `kind`; returns the actor ids started or retiring."""
        kind = validate_scale(self.topo, kind, n)
        spec = self.topo.actor(kind)
        live = sorted((a for a in self.actors.values() if a.kind == kind and a.state not in ("retiring", "retired")),
                      key=lambda a: a.replica)
        changed = []
        if n > len(live):
            used = {a.replica for a in self.actors.values() if a.kind == kind and a.state != "retired"}
            r = 0
            for _ in range(n - len(live)):
                while r in used:
                    r += 1
                used.add(r)
                ap = await self._spawn(spec, r)
                changed.append(ap.actor_id)
        else:
            for ap in live[n:][::-1]:
                ap.state = "retiring"
                if before_retire is not None:
                    before_retire(ap.actor_id)
                await self.peers.send(ap.actor_id, P.Shutdown(drain=True))
                changed.append(ap.actor_id)
        self.topo = self.topo.with_replicas(kind, n)
        return changed

    async def shutdown(self, timeout: float = 15.0) -> None:
        self.stopping = True
        procs = [a.proc for a in self.actors.values() if a.proc and a.proc.returncode is None]
        for a in self.actors.values():
            if a.proc and a.proc.returncode is None:
                try:
                    await asyncio.wait_for(self.peers.send(a.actor_id, P.Shutdown(drain=True)), 1.0)
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for p in procs:
            left = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(p.wait(), left)
            except asyncio.TimeoutError:
                try:
                    p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for a in self.actors.values():  # an engine's other ranks die with it; kill any left anyway
            for r in a.info.get("ranks", [])[1:]:
                _kill_if_alive(r.get("pid"), a.pid)
        for t in self._tasks:
            t.cancel()
        self.inbox.close()
        self.peers.close()


def engine_actor_config(topo: Topology, spec: ActorSpec, model_path: str) -> EngineActorConfig:
    """An engine entry's typed section (also what the ranks of another node are built from)."""
    engine = topo.engine_config(spec)
    if engine.model is not None or engine.load_format != "dummy":
        engine = engine.replace(model=model_path)
    nodes = topo.nodes
    return EngineActorConfig(engine=engine, log_interval=topo.log.log_interval, tp=spec.tp, ep=spec.ep,
                             nnodes=nodes.nnodes, dist_init_addr=nodes.dist_init_addr,
                             curve_key_file=nodes.curve_key_file)


def _kill_if_alive(pid: int | None, parent: int | None) -> None:
    """SIGKILL `pid` if it is still a child of engine process `parent` (or orphaned to init)."""
    if not pid:
        return
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid in (parent, 1):
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass
