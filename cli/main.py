"""The `glmrt` command: one subcommand per module of cli/."""

from __future__ import annotations

import argparse
import sys

from cli import bench_offline, compute_mamba_ratio, make_checkpoint

# `glmrt bench <name>`: one module per benchmark, each with add_parser(bench_sub) and run(args).
BENCHMARKS = [bench_offline]


def _not_yet(name: str, issue: str):
    def run(_args: argparse.Namespace) -> int:
        print(f"glmrt {name}: not available in this build yet (it lands with the {issue}); "
              "see README.md for what works today", file=sys.stderr)
        return 2
    return run


def _add_bench_group(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (offline: the in-process engine)",
                           description="Benchmarks. Each one is a subcommand: glmrt bench NAME --help.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for module in BENCHMARKS:
        module.add_parser(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glmrt", description="Serve the GLM-5.3-Flash model family.")
    sub = parser.add_subparsers(dest="command", required=True)
    make_checkpoint.add_parser(sub)
    compute_mamba_ratio.add_parser(sub)
    _add_bench_group(sub)
    up = sub.add_parser("up", help="start a deployment (the actor runtime)")
    up.add_argument("topology", nargs="?")
    up.set_defaults(func=_not_yet("up", "actor-runtime issue"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if rest and args.command != "up":
        build_parser().parse_args(argv)  # reports the unknown arguments
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
