"""Entry point of an actor process: `python -m actors.worker '<RunSpec JSON>'`.

The process dies with its supervisor (PR_SET_PDEATHSIG on Linux), so a killed `glmrt up`
never leaves actors behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import signal
import sys

from actors.base import RunSpec


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def actor_class(kind: str):
    if kind in ("engine", "prefill", "decode"):
        from actors.engine import EngineActor
        return EngineActor
    if kind == "tokenizer":
        from actors.tokenizer import TokenizerActor
        return TokenizerActor
    if kind == "vision":
        from actors.vision import VisionActor
        return VisionActor
    if kind == "detokenizer":
        from actors.detokenizer import DetokenizerActor
        return DetokenizerActor
    raise ValueError(f"no actor of kind {kind!r} in this build")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    payload = json.loads(argv[0])
    specs = [RunSpec(**d) for d in payload["actors"]] if "actors" in payload else [RunSpec(**payload)]
    logging.basicConfig(level=logging.INFO,
                        format=f"[{','.join(s.actor_id for s in specs)}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop

    async def run_all() -> None:
        import zmq.asyncio
        ctx = zmq.asyncio.Context()  # co-located actors share it: their links are inproc://
        await asyncio.gather(*(actor_class(s.kind)(s, ctx).run() for s in specs))

    try:
        import uvloop
        uvloop.run(run_all())
    except ImportError:
        asyncio.run(run_all())
    return 0


if __name__ == "__main__":
    sys.exit(main())
