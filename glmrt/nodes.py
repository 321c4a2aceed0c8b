"""A deployment over several nodes (`[nodes]`, `--nnodes N --node-rank K --dist-init-addr HOST:PORT`).
No torch.

Every node runs `glmrt up` with the same topology. Node 0 runs every actor but the engine's
other ranks, the api and the supervisor; node K > 0 runs only its share of the one engine's
ranks: an engine of tp T over N nodes puts T / N consecutive ranks on each node (node K holds
ranks K*T/N .. (K+1)*T/N - 1, as SGLang places them), so rank 0 is on node 0. The ranks meet at
the torch.distributed store on HOST:PORT (node 0's address, hosted by rank 0), and the step
inputs reach them on one ZMQ CURVE link that rank 0 binds on HOST (transport/node_link.py).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable

from glmrt.config_bounds import bounded



class NodesError(ValueError):
    """A [nodes] setting that cannot run; the message names the flag or key."""


@dataclass(frozen=True)
class NodeSection:
    nnodes: int = bounded(1, ge=1)
    """Nodes the deployment runs on (1: one host, the ranks meet at a file in the run directory)."""
    node_rank: int = bounded(0, ge=0)
    """This node's rank, 0 .. nnodes - 1 (0 runs the api, the supervisor and every actor but the
    engine's ranks of the other nodes)."""
    dist_init_addr: str | None = None
    """HOST:PORT of node 0, which every node reaches: the ranks' torch.distributed store listens on
    PORT and the step-input link binds on HOST (needed with nnodes > 1)."""
    curve_key_file: str | None = None
    """A ZMQ CURVE secret key file every node holds (`zmq.auth.create_certificates`' `.key_secret`);
    unset: keys are made at start and exchanged through the store."""


def split_addr(addr: str) -> tuple[str, int]:
    """"HOST:PORT" (or "[v6]:PORT") -> (host, port); ValueError names what is wrong."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{addr!r} is not HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} of {addr!r} is not in 1..65535")
    if is_wildcard(host):
        raise ValueError(f"{addr!r} names no host: give node 0's own address, which the other nodes connect to "
                         "(the link binds only there)")
    return host, int(port)


def is_wildcard(host: str) -> bool:
    """Whether binding on `host` would listen on every interface: "", "*", or any spelling of
    0.0.0.0 / :: ("0", "::ffff:0.0.0.0", a name that resolves to one)."""
    if host in ("", "*"):
        return True
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False  # a name that does not resolve fails where it is used, with its own message
    for text in found:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
        if addr.version == 6 and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if addr.is_unspecified:
            return True
    return False


def tcp_url(host: str, port: int | str) -> str:
    """tcp://host:port, an IPv6 literal in brackets."""
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"tcp://[{host}]:{port}" if v6 else f"tcp://{host}:{port}"


def node_ranks(tp: int, nnodes: int, node_rank: int) -> range:
    """The engine ranks node `node_rank` runs: tp / nnodes consecutive ones."""
    per = tp // nnodes
    return range(node_rank * per, (node_rank + 1) * per)


def check_nodes(nodes: NodeSection, actors, spell: Callable[[str], str]) -> None:
    """The placement rules of a deployment over several nodes (the fields' own bounds are
    check_fields'): raise NodesError, one line naming the flag or key."""
    n, k = nodes.nnodes, nodes.node_rank
    if not isinstance(k, int) or not 0 <= k < n:
        raise NodesError(f"{spell('node_rank')} {k} is out of range for {spell('nnodes')} {n} (0..{n - 1})")
    if n == 1:
        if nodes.dist_init_addr is not None:
            raise NodesError(f"{spell('dist_init_addr')} is for a deployment over several nodes; "
                             f"set {spell('nnodes')} too, or leave it out")
        if nodes.curve_key_file is not None:
            raise NodesError(f"{spell('curve_key_file')} secures the link between nodes; with {spell('nnodes')} 1 "
                             "every socket is on ipc in the run directory: leave it out")
        return
    if nodes.dist_init_addr is None:
        raise NodesError(f"{spell('nnodes')} {n} needs {spell('dist_init_addr')} HOST:PORT (node 0's address, "
                         "which every node reaches)")
    try:
        split_addr(nodes.dist_init_addr)
    except ValueError as e:
        raise NodesError(f"{spell('dist_init_addr')}: {e}") from None
    engines = [a for a in actors if a.kind in ("engine", "prefill", "decode")]
    if [a.kind for a in engines] != ["engine"]:
        raise NodesError(f"{spell('nnodes')} {n}: a deployment over several nodes runs one 'engine' entry whose "
                         "ranks are spread over the nodes; prefill/decode over nodes is not built")
    (e,) = engines
    if e.replicas != 1:
        raise NodesError(f"{spell('nnodes')} {n}: the engine runs one replica over the nodes (got replicas "
                         f"{e.replicas})")
    if e.tp < n or e.tp % n:
        raise NodesError(f"{spell('nnodes')} {n} must divide the engine's tp ({e.tp}): each node runs tp / nnodes "
                         "of its ranks")
