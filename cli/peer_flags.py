"""The flags of SGLang's GLM-5.3-Flash recipes that `glmrt up` does not take as its own: one row
each, saying what glmrt does instead.

A user pastes a recipe's command line; each of these flags is refused in one line that names the
glmrt way (`glmrt up: error: --tp-size: ...`, exit status 2) instead of argparse's bare
"unrecognized arguments". A row may accept the values that name what glmrt already does
(`--tool-call-parser glm47`). When glmrt builds one of these features, its flag
moves out of this table into `glmrt up`'s own flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerFlag:
    names: tuple[str, ...]
    """The flag and its aliases, as SGLang spells them."""
    instead: str
    """What glmrt does instead: the refusal's text."""
    takes_value: bool = True
    """False: a switch (`--enable-dp-attention`)."""
    accepts: tuple[str, ...] = ()
    """Values that name what glmrt already does: accepted, the rest refused."""


_DP_ATTENTION = ("data-parallel attention is not built yet; an engine of --tp-size N splits attention heads over "
                 "its N ranks, and --dp-size N runs N engine replicas")
_DRAFT_MODEL = ("glmrt drafts with the checkpoint's own MTP layer (--speculative-algorithm EAGLE); a separate "
                "draft model is not built")
_HICACHE_STORAGE = ("glmrt's third cache tier is a local-disk store: --hicache-storage-dir DIR "
                    "(--hicache-storage-size GB); no other storage backend is built")
_CONTEXT_PARALLEL = ("context parallelism is not built yet; one engine prefills a prompt in chunks of "
                     "--chunked-prefill-size tokens")

PEER_FLAGS: tuple[PeerFlag, ...] = (
    PeerFlag(("--enable-dp-attention",), _DP_ATTENTION, takes_value=False),
    PeerFlag(("--moe-dense-tp-size",), "glmrt splits the dense layers over the engine's --tp-size ranks like the "
             "rest of the model; drop the flag"),
    PeerFlag(("--attn-cp-size",), _CONTEXT_PARALLEL, accepts=("1",)),
    PeerFlag(("--enable-prefill-cp",), _CONTEXT_PARALLEL, takes_value=False),
    PeerFlag(("--speculative-draft-model-path",), _DRAFT_MODEL),
    PeerFlag(("--hicache-storage-backend",), _HICACHE_STORAGE),
    PeerFlag(("--cuda-graph-backend-prefill",), "glmrt captures CUDA graphs for decode only (--cuda-graph-max-bs, "
             "--disable-cuda-graph); prefill runs eagerly", accepts=("off",)),
    PeerFlag(("--encoder-only",), 'the vision encoder runs as its own actor when the topology file places one: '
             '[[actors]] kind = "vision"', takes_value=False),
    PeerFlag(("--language-only",), 'the engine leaves the vision encoder to a vision actor when the topology file '
             'places one: [[actors]] kind = "vision"', takes_value=False),
    PeerFlag(("--disaggregation-mode",), 'a topology file places the prefill and decode engines of one '
             'deployment: [[actors]] kind = "prefill" and kind = "decode"'),
    PeerFlag(("--disaggregation-transfer-backend",), "set GLMRT_KV_TRANSFER=nixl|zmq (default auto)"),
    PeerFlag(("--grammar-backend",), "glmrt compiles structured output (response_format, regex, ebnf, forced "
             "tool calls) with xgrammar and no other backend", accepts=("xgrammar",)),
    PeerFlag(("--reasoning-parser",), "glmrt parses GLM-5.3's reasoning (the glm45 format) and no other",
             accepts=("glm45",)),
    PeerFlag(("--tool-call-parser",), "glmrt parses GLM-5.3's tool calls (the glm47 format) and no other",
             accepts=("glm47",)),
    PeerFlag(("--trust-remote-code",), "glmrt runs no code from a checkpoint (the GLM-5.3 model is built in); drop "
             "the flag", takes_value=False),
    PeerFlag(("--chat-template",), "glmrt renders GLM-5.3's chat template (built in); drop the flag"),
    PeerFlag(("--decode-log-interval",), "glmrt prints each engine's stats line every --log-interval seconds "
             "(default 10; 0: off), not every N decode steps"),
)


class _PeerAction(argparse.Action):
    """Refuses the flag (and a value it does not accept) as it is parsed, before anything starts."""

    def __init__(self, option_strings, dest, row: PeerFlag, **kw) -> None:
        self.row = row
        super().__init__(option_strings, dest, nargs=None if row.takes_value else 0, default=argparse.SUPPRESS,
                         **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.row.takes_value and values in self.row.accepts:
            return   # it names what glmrt does
        parser.exit(2, f"{parser.prog}: error: {option_string}: {self.row.instead}\n")


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("flags of SGLang's recipes (refused, saying what glmrt does instead)")
    for row in PEER_FLAGS:
        accepted = f"accepted: {', '.join(row.accepts)}; else refused: " if row.accepts else "refused: "
        g.add_argument(*row.names, action=_PeerAction, row=row, metavar="VALUE" if row.takes_value else None,
                       help=(accepted + row.instead).replace("%", "%%"))
