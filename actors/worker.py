"""Entry point of an actor process: `python -m actors.worker '<RunSpecs JSON>'` (actors.base.encode_run_specs).

The process dies with its supervisor (PR_SET_PDEATHSIG on Linux), so a killed `glmrt up`
never leaves actors behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import signal
import sys

from actors.base import decode_run_specs
from actors.logs import configure_logging
from glmrt.actor_kinds import kind_of


def die_with_parent() -> None:
    """This process gets SIGKILL when the thread that started it ends."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def actor_class(kind: str):
    """The actor class of `kind`, imported here (glmrt.actor_kinds names it by import path)."""
    module, _, name = kind_of(kind).actor_class.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    specs = decode_run_specs(argv[0])
    configure_logging(specs[0].log.level)   # one deployment-wide level: co-located specs agree
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
