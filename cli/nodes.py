"""`glmrt up --nnodes N --node-rank K --dist-init-addr HOST:PORT`: the parts of a deployment over
several nodes that `glmrt up` itself runs (glmrt.nodes says how the ranks are placed).

Node 0 runs the whole deployment (cli/up.py: serve); its engine actor is rank 0 and hosts the
ranks' store on PORT. A node K > 0 runs `serve_node`: it starts its share of the engine's ranks
(actors/engine_rank.py: RankGroup), which join rank 0's group, and exits when one of them does:
status 0 when rank 0 ended the group (node 0 stopped), 1 when its group failed (rank 0 or a
rank was lost: each rank exits then, see transport/node_link.py), 2 when its engine settings
are not rank 0's (checked at the store before the group forms; rank 0 goes on waiting). SIGTERM or Ctrl-C ends its
ranks, which node 0 sees as its engine failing. This process never imports torch.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading

from glmrt.nodes import NodeSection, node_ranks, split_addr, tcp_url

log = logging.getLogger("glmrt")

POLL_S = 0.1


def check_node_addresses(nodes: NodeSection) -> str | None:
    """What only this machine can answer, before anything starts: the key file can be read, and on
    node 0 the --dist-init-addr host is one of its own addresses (the link binds there) and its
    port is free (the ranks' store listens there). Returns the refusal, or None."""
    if nodes.nnodes == 1:
        return None
    if nodes.curve_key_file:
        from transport.node_link import load_key_file
        try:
            load_key_file(nodes.curve_key_file)
        except ValueError as e:
            return f"--curve-key-file: {e}"
    if nodes.node_rank > 0:
        return None  # node 0 may start after this one: its ranks wait for it
    host, port = split_addr(nodes.dist_init_addr)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        return f"--dist-init-addr: cannot resolve {host!r}: {e.strerror or e}"
    for p, what in ((0, "address"), (port, "port")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, p))
        except OSError as e:
            if what == "address":
                return (f"--dist-init-addr: {host} is not an address of this machine ({e.strerror or e}); node 0 "
                        "runs rank 0, which listens there: give this node's own address")
            if e.errno == errno.EADDRINUSE:
                return f"--dist-init-addr: port {port} on {host} is in use; pick another port for the ranks' store"
            return f"--dist-init-addr: cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def serve_node(topo, path: str) -> int:
    """Node K > 0: start its engine ranks and wait until they end (see the module doc)."""
    from actors.engine_rank import REFUSED, RankGroup
    from actors.supervisor import engine_actor_config
    from cli.up import check_model

    mc = check_model(topo, path)
    if isinstance(mc, int):
        return mc
    nodes = topo.nodes
    spec = topo.actor("engine")
    cfg = engine_actor_config(topo, spec, path)
    host, port = split_addr(nodes.dist_init_addr)
    ranks = node_ranks(spec.tp, nodes.nnodes, nodes.node_rank)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    group = RankGroup("engine/0", spec.tp, spec.ep, tcp_url(host, port), cfg.engine, list(spec.gpus),
                      topo.log.log_level, cfg.torch_threads, log, ranks=ranks, watch=False, nnodes=nodes.nnodes,
                      node_rank=nodes.node_rank, curve_key_file=nodes.curve_key_file)
    log.info("node %d of %d: engine ranks %s (tp %d, ep %d) joining rank 0 at %s:%d", nodes.node_rank,
             nodes.nnodes, ", ".join(f"{r['rank']} (pid {r['pid']}, {r['device']})" for r in group.ranks()),
             spec.tp, spec.ep, host, port)
    while not stop.wait(POLL_S):
        for rank, proc in zip(group.rank_ids, group.procs):
            rc = proc.poll()
            if rc is None:
                continue
            if rc == 0:  # rank 0 told the group to stop: the others leave too
                log.info("rank %d left: rank 0 ended the engine; this node stops", rank)
                group.wait_stopped()
                return 0
            if rc == REFUSED:  # its log line above says which settings differ from rank 0's
                log.error("rank %d was refused by rank 0: this node stops", rank)
            else:
                log.error("rank %d (pid %d) exited with status %s: this node's engine group failed; this node "
                          "stops", rank, proc.pid, rc)
            group.kill()
            group.wait_stopped()
            return REFUSED if rc == REFUSED else 1
    log.info("stopping this node's ranks")
    group.kill()
    group.wait_stopped()
    return 0
