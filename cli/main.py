"""The `glmrt` command: one subcommand per module of cli/.

Subcommand modules import torch only inside their run functions: `glmrt up` runs the
supervisor and the api actor, which never load torch.
"""

from __future__ import annotations

import argparse
import sys

import glmrt
from cli import admin, bench_offline, bench_serving, compute_mamba_ratio, eval as eval_cli, make_checkpoint, train, up
from cli.parsing import GlmrtParser

# `glmrt bench <name>`: one module per benchmark, each with add_parser(bench_sub) and run(args).
BENCHMARKS = [bench_offline, bench_serving]


def _add_bench_group(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (offline: the in-process engine)",
                           description="Benchmarks. Each one is a subcommand: glmrt bench NAME --help.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for module in BENCHMARKS:
        module.add_parser(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = GlmrtParser(prog="glmrt", description="Serve the GLM-5.3-Flash model family.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"glmrt {glmrt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)  # each subcommand's parser is a GlmrtParser
    up.add_parser(sub)
    admin.add_parsers(sub)
    make_checkpoint.add_parser(sub)
    compute_mamba_ratio.add_parser(sub)
    train.add_parser(sub)
    eval_cli.add_parser(sub)
    _add_bench_group(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # said by the subcommand that got them, in one line
        prog = " ".join(["glmrt", args.command] + ([args.benchmark] if getattr(args, "benchmark", None) else []))
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
