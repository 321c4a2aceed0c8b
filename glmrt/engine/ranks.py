"""An engine on several ranks: the one value every rank runs per step, and how it reaches them.

An engine of tp N is N processes. Rank 0 holds the scheduler and the requests; it turns each
step's plan into `ForwardInputs` (host values only: token ids, the batch's positions, slots and
page tables, the state and page copies around the forward, which rows' logits to compute, the
graph to replay) and runs it through `ModelRunner.run`, which first publishes it to the other
ranks. Those run the same `ModelRunner.run` on what they receive (`ModelRunner.follow`), so
every rank enters the forward's collectives with the same shapes, in the same order. Sampling
happens on rank 0 alone; a step whose tokens feed the next step's inputs on the device (the
overlap schedule) broadcasts them, so the other ranks have them too.

The inputs travel as msgspec (never pickle) on a torch.distributed broadcast over a gloo group
(the ranks' own group on the CPU, a second one beside NCCL on a GPU, as SGLang does): a length,
then the bytes. At tp 1 there is no link and nothing is broadcast.
"""

from __future__ import annotations

import datetime
import os

import msgspec
import torch
import torch.distributed as dist

from glmrt.parallel import Parallel

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # a rank loads its weights before the first collective
LEAVE_TIMEOUT = datetime.timedelta(seconds=5)  # how long a leaving rank waits for the others


class StateCopy(msgspec.Struct, array_like=True):
    """One state slot (and partial KV page) copied to another (a restore, save or fork)."""

    src_slot: int
    dst_slot: int
    src_page: int | None = None
    dst_page: int | None = None


class ForwardInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step runs on every rank (op "forward"), or a command to all of them."""

    op: str = "forward"
    """forward | draft (one step of the MTP draft chain: one row per request, at the draft position
    `prefix_lens[r]`) | rollback (speculative decoding: snapshots back, then the stateful ops over
    the kept rows of the last verify forward, glmrt/engine/rollback.py) | capture (decode CUDA
    graphs, in `graphs`' order) | stop (the engine ends)."""
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

    def __init__(self, parallel: Parallel, host_group):
        self.parallel = parallel
        self.group = host_group  # gloo: host tensors

    def publish(self, step: ForwardInputs) -> None:
        data = _encoder.encode(step)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.long), group_src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), group_src=0, group=self.group)

    def receive(self) -> ForwardInputs:
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, group_src=0, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, group_src=0, group=self.group)
        return _decoder.decode(buf.numpy().tobytes())

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


def join_group(rank: int, tp_size: int, ep_size: int, rendezvous: str, device: str) -> tuple[Parallel, PlanLink]:
    """This process's rank in its engine's torch.distributed group (NCCL on CUDA, gloo on the
    CPU) and the gloo link the step inputs travel on."""
    cuda = device.startswith("cuda")
    kw = {"device_id": torch.device(device if ":" in device else "cuda:0")} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=tp_size, timeout=GROUP_TIMEOUT, **kw)
    world = dist.group.WORLD
    host = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT) if cuda else world
    global _host_group
    _host_group = host
    parallel = Parallel(rank=rank, tp_size=tp_size, ep_size=ep_size, group=world)
    return parallel, PlanLink(parallel, host)


_host_group = None


def leave_group() -> None:
    """Leave the group together: ranks that tear gloo down while a peer still sends on it can
    abort in gloo's threads ("terminate called without an active exception"), so wait (a few
    seconds at most: a dead peer must not hold the exit) until every rank is leaving."""
    global _host_group
    if not dist.is_initialized():
        return
    try:
        dist.monitored_barrier(group=_host_group, timeout=LEAVE_TIMEOUT)
    except RuntimeError:
        pass  # a rank is gone already: leave anyway
    _host_group = None
    dist.destroy_process_group()
