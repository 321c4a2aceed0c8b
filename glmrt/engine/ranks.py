"""An engine on several ranks: the one value every rank runs per step, and how it reaches them.

An engine of tp N is N processes. Rank 0 holds the scheduler and the requests; it turns each
step's plan into `ForwardInputs` (host values only: token ids, the batch's positions, slots and
page tables, the state and page copies around the forward, which rows' logits to compute, the
graph to replay) and runs it through `ModelRunner.run`, which first publishes it to the other
ranks. Those run the same `ModelRunner.run` on what they receive (`ModelRunner.follow`), so
every rank enters the forward's collectives with the same shapes, in the same order. Sampling
happens on rank 0 alone; a step whose tokens feed the next step's inputs on the device (the
overlap schedule) broadcasts them, so the other ranks have them too.

A prefill or decode engine adds three ops: rank 0 gathers the ranks' transfer-engine infos
once (handoff_info), has the other ranks post their KDA shards of a handoff right after its own
writes (handoff_write, `RankWrite`) and asks which of theirs ended (handoff_poll, `RankReport`,
gathered on the same link), so every copy a rank makes comes from rank 0's plan.

The inputs travel as msgspec (never pickle) on a torch.distributed broadcast over a gloo group
(the ranks' own group on the CPU, a second one beside NCCL on a GPU, as SGLang does): a length,
then the bytes. At tp 1 there is no link and nothing is broadcast. When the ranks span nodes
they meet at a TCP store on node 0 instead of a file, and the step inputs travel on an
encrypted ZMQ link (`wire`, transport/node_link.py, built by actors/engine_rank.py) instead.
"""

from __future__ import annotations

import datetime
import os
import socket

import msgspec
import torch
import torch.distributed as dist

from glmrt import protocol as P
from glmrt.cache.host_pool import HostOp
from glmrt.parallel import Parallel

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a rank loads its weights before the first collective
LEAVE_TIMEOUT = datetime.timedelta(seconds=5)  # how long a leaving rank waits for the others


class StateCopy(msgspec.Struct, array_like=True):
    """One state slot (and partial KV page) copied to another (a restore, save or fork)."""

    src_slot: int
    dst_slot: int
    src_page: int | None = None
    dst_page: int | None = None


class RankWrite(msgspec.Struct, array_like=True):
    """PD prefill: one request's KDA shard that every rank r > 0 writes from its own pools into
    the same-numbered rank of the decode group (rank 0 writes its own shard and the replicated
    rows itself). Rows are rank 0's allocation on both sides, so they are the same on every rank."""

    rid: str
    peers: list[str]
    """The decode ranks' transfer-engine names, by rank."""
    infos: list[bytes]
    """Their peer infos, by rank (a rank connects again when one changed: a restarted decode)."""
    local: list[P.AnyStateComponent]
    remote: list[P.AnyStateComponent]
    checksum: bool = False


class RankReport(msgspec.Struct, array_like=True):
    """A rank's answer to op "handoff_poll": one of its writes finished (or failed, or timed out)."""

    rid: str
    ok: bool
    seconds: float = 0.0
    error: str | None = None


class ForwardInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step runs on every rank (op "forward"), or a command to all of them."""

    op: str = "forward"
    """forward | draft (one step of the MTP draft chain: one row per request, at the draft position
    `prefix_lens[r]`) | rollback (speculative decoding: snapshots back, then the stateful ops over
    the kept rows of the last verify forward, glmrt/engine/rollback.py) | capture (decode CUDA
    graphs, in `graphs`' order) | stop (the engine ends) | handoff_info (each rank gives rank 0 its
    transfer engine's peer info) | handoff_write (each rank > 0 posts its part of `writes`) |
    handoff_poll (each rank > 0 reports the writes that finished, `RankReport`s)."""
    ids: list[int] = []
    """Input token ids of the flat batch (a row fed from the previous step's tokens holds 0)."""
    prefix_lens: list[int] = []
    seq_lens: list[int] = []
    slot_ids: list[int] = []
    page_tables: list[list[int]] = []
    logits_rows: list[int] | None = None
    """Rows of the flat batch whose logits are computed (None: one per request, the graph's)."""
    src_rows: list[int] | None = None
    """Overlap: row r's input is token src_rows[r] of the previous shared tokens (-1: ids[r])."""
    before: list[StateCopy] = []
    """Copies before the forward (restores from checkpoints)."""
    after: list[StateCopy] = []
    """Copies after it (saves and forks of the state it produced)."""
    embed_rows: list[int] = []
    """Rows whose input embedding is a vision feature; rank 0 broadcasts the features."""
    graph: tuple[int, int] | None = None
    """The decode graph (batch bucket, page bucket) that runs this batch (None: eager)."""
    graphs: list[tuple[int, int]] = []
    """op capture: the graphs to capture."""
    share_tokens: bool = False
    """Rank 0 broadcasts the tokens it samples from this step (one per request row)."""
    keep_hidden: list[tuple[int, int]] = []
    """(k, slot): the final hidden state of logits row k kept in `slot` (a prompt end's save)."""
    hit_slots: list[int] = []
    """Full hits: sampled from the hidden state kept in each slot, after the forward's rows."""
    sample_order: list[int] | None = None
    """With full hits: the sampled rows in plan order, as indices into [forward rows; hit rows]."""
    writes: list[RankWrite] = []
    """op handoff_write: the PD state writes ranks > 0 post (their KDA shards)."""
    host_ops: list[HostOp] = []
    """The host tier's copies, fences and disk entries rank 0 issued since the previous step, in
    order: every other rank performs them on its own shard before this step's copies."""
    host_ready: list[int] = []
    """Host-tier loads (tickets, numbered alike on every rank) rank 0 has seen finish since the
    previous step: the forward may read their rows, so the other ranks' compute waits for them."""
    draft_extend: bool = False
    """Speculative decoding: after the forward, the MTP draft layer runs over the same positions
    (position j's input: the final hidden state at j and token j + 1) and each request's last final
    hidden state is kept in its slot, before the copies after the forward."""
    capture: list[int] = []
    """Speculative decoding: the requests (indices into this forward's) whose stateful ops' inputs
    are kept for a rollback; op rollback: the kept request each row's request is."""
    chain_rows: list[int] | None = None
    """op draft: row r continues row chain_rows[r] of the previous draft step (None: the chain's
    first step, from the hidden state kept in each slot)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardInputs)


class PlanLink:
    """Rank 0 publishes each step's ForwardInputs; the other ranks receive them, in order."""

    def __init__(self, parallel: Parallel, host_group, wire=None):
        self.parallel = parallel
        self.group = host_group  # gloo: host tensors
        self.wire = wire  # ranks on several nodes: the inputs go on this link (send / recv of bytes)

    def publish(self, step: ForwardInputs) -> None:
        data = _encoder.encode(step)
        if self.wire is not None:
            if step.op == "stop":
                self.wire.quiet()  # the ranks leave now: their going is not a failure
            self.wire.send(data)
            return
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), group_src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), group_src=0, group=self.group)

    def receive(self) -> ForwardInputs:
        if self.wire is not None:
            step = _decoder.decode(self.wire.recv())
            if step.op == "stop":
                self.wire.quiet()
            return step
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, group_src=0, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, group_src=0, group=self.group)
        return _decoder.decode(buf.numpy().tobytes())

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (one length on all ranks), in rank order."""
        mine = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(mine) for _ in range(self.parallel.tp_size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (any lengths), in rank order."""
        sizes = [n for (n,) in self.gather([len(data)])]
        mine = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in sizes]
        dist.all_gather(out, mine, group=self.group)
        return [t[:n].numpy().tobytes() for t, n in zip(out, sizes)]

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (each rank's cache budget: one pool size for all)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def rendezvous_path(run_dir: str, actor_id: str) -> str:
    """The file (in the deployment's 0700 run dir) an engine's ranks meet at; one per start.
    The files of this actor's earlier starts are removed: a group that died (a rank killed)
    never deleted its own, and one actor id runs one engine at a time."""
    prefix = f"{actor_id.replace('/', '-')}-"
    mine = f"{prefix}{os.getpid()}.ranks"
    for name in os.listdir(run_dir):
        if name.startswith(prefix) and name.endswith(".ranks") and name != mine:
            try:
                os.unlink(os.path.join(run_dir, name))
            except FileNotFoundError:
                pass
    return os.path.join(run_dir, mine)


def join_group(rank: int, tp_size: int, ep_size: int, rendezvous: str, device: str,
               wire=None, meet=None) -> tuple[Parallel, PlanLink]:
    """This process's rank in its engine's torch.distributed group (NCCL on CUDA, gloo on the
    CPU) and the link the step inputs travel on: gloo, or with a `tcp://HOST:PORT` rendezvous
    (ranks on several nodes; rank 0 hosts the store) `wire(store)`'s. `meet(store)` runs before
    the group forms, so a rank it refuses leaves without disturbing the others."""
    cuda = device.startswith("cuda")
    kw = {"device_id": torch.device(device if ":" in device else "cuda:0")} if cuda else {}
    store = None
    if rendezvous.startswith("tcp://"):
        host, _, port = rendezvous.removeprefix("tcp://").rpartition(":")
        host = host.strip("[]")
        listen = _listen(host, int(port)) if rank == 0 else None
        store = dist.TCPStore(host, int(port), tp_size, is_master=rank == 0, timeout=GROUP_TIMEOUT,
                              wait_for_workers=False, master_listen_fd=listen.fileno() if listen else None)
        if meet is not None:
            meet(store)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=tp_size,
                                timeout=GROUP_TIMEOUT, **kw)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=tp_size, timeout=GROUP_TIMEOUT, **kw)
    world = dist.group.WORLD
    host = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if cuda else world
    global _host_group, _wire
    _host_group = host
    _wire = wire(store) if wire is not None and store is not None else None
    parallel = Parallel(rank=rank, tp_size=tp_size, ep_size=ep_size, group=world)
    return parallel, PlanLink(parallel, host, _wire)


_host_group = None
_wire = None
_store_socket = None


def _listen(host: str, port: int):
    """Rank 0's store socket, bound on the named host only (TCPStore alone listens on every
    interface); kept open for the process's life, as the store serves from it."""
    global _store_socket
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted rank 0 takes the port again at once
    s.bind((host, port))
    s.listen(128)
    _store_socket = s
    return s


def leave_group() -> None:
    """Leave the group together: ranks that tear gloo down while a peer still sends on it can
    abort in gloo's threads ("terminate called without an active exception"), so wait (a few
    seconds at most: a dead peer must not hold the exit) until every rank is leaving."""
    global _host_group, _wire
    if not dist.is_initialized():
        return
    if _wire is not None:
        _wire.quiet()
    try:
        dist.monitored_barrier(group=_host_group, timeout=LEAVE_TIMEOUT)
    except RuntimeError:
        pass  # a rank is gone already: leave anyway
    if _wire is not None:  # after the barrier: every rank has its stop by now (closing drops what is queued)
        _wire.close()
        _wire = None
    _host_group = None
    dist.destroy_process_group()
