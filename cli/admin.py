"""`glmrt status | scale | down`: act on a running deployment through its admin routes."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from glmrt import env
from glmrt.actor_kinds import ENGINE_KINDS


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, helptext in (("status", "show every actor, its placement, state and load (and each engine's ranks)"),
                           ("scale", "set the replica count of an actor kind: glmrt scale engine=2"),
                           ("down", "drain and stop a deployment")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--url", default=env.url())
        p.add_argument("--api-key", default=env.api_key())
        if name == "status":
            p.add_argument("--json", action="store_true")
        if name == "scale":
            p.add_argument("assignment", help="KIND=N, e.g. tokenizer=2 or engine=3")
        p.set_defaults(func=globals()[f"_{name}"])


def _call(args, method: str, route: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.url.rstrip("/") + route, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except Exception:
            msg = str(e)
        raise SystemExit(f"error: {e.code} {msg}")
    except urllib.error.URLError as e:
        raise SystemExit(f"error: cannot reach {args.url}: {e.reason}")


def _status_fields(kind: str) -> tuple[str, ...]:
    """An actor's fields in `glmrt status --json`; an engine's add its requests running and waiting
    (queued), from its latest stats, its tp / ep sizes and its ranks (each one's pid and device)."""
    common = ("kind", "replica", "pid", "host", "gpus", "state", "load")
    return common + ("running", "waiting", "tp", "ep", "ranks") if kind in ENGINE_KINDS else common


def _ranks_line(a: dict) -> str | None:
    """An engine's ranks under its row: "tp 2, ep 1; rank 0: pid 41 on cuda:0, rank 1: ..."."""
    if a["kind"] not in ENGINE_KINDS or not a.get("ranks"):
        return None
    ranks = ", ".join(f"rank {r['rank']}: pid {r['pid']} on {r['device']}"
                      + (f" of node {r['node']} ({r['host']})" if "node" in r else "") for r in a["ranks"])
    return f"{'':<12} tp {a.get('tp')}, ep {a.get('ep')}; {ranks}"


def _status(args) -> int:
    out = _call(args, "GET", "/admin/status")
    if args.json:
        print(json.dumps({"actors": [{k: a.get(k) for k in _status_fields(a["kind"])} for a in out["actors"]]}))
        return 0
    print(f"{'kind':<12} {'replica':>7} {'pid':>8} {'state':<10} {'load':>6} {'running':>7} {'waiting':>7}  gpus")
    for a in out["actors"]:
        print(f"{a['kind']:<12} {a['replica']:>7} {a['pid'] or '-':>8} {a['state']:<10} {a['load']:>6.2f} "
              f"{a.get('running', 0):>7} {a.get('waiting', 0):>7}  {a['gpus'] or '-'}")
        line = _ranks_line(a)
        if line:
            print(line)
    return 0


def _scale(args) -> int:
    from glmrt.topology_checks import check_scale_request

    kind, _, n = args.assignment.partition("=")
    if not n.isdigit():
        print("glmrt scale: error: expected KIND=N, e.g. engine=2", file=sys.stderr)
        return 2
    try:
        check_scale_request(kind, int(n))   # the deployment checks the rest (which kinds it runs)
    except ValueError as e:
        print(f"glmrt scale: error: {e}", file=sys.stderr)
        return 2
    out = _call(args, "POST", "/admin/scale", {"kind": kind, "replicas": int(n)})
    print(f"{kind}: {out['replicas']} replica(s); changed: {', '.join(out['changed']) or 'nothing'}")
    return 0


def _down(args) -> int:
    _call(args, "POST", "/admin/shutdown", {})
    print("shutting down")
    return 0
