"""The trade of --state-checkpoint-interval on the serving workloads, in process.

    PYTHONPATH=. python bench/checkpoint_interval.py [--preset tiny] [--input-len 1024] \
        [--intervals 0,256,1024,4096,8192] [--num-prompts 16] [--num-groups 4] [--num-turns 3]

For each interval, the shared-prefix and multi-turn workloads of `glmrt bench serving`
(cli.bench_serving.make_workload, token-id prompts, one conversation turn after another, the
arrivals in order) run on one engine; printed per workload: the prompt tokens, the prefill
tokens computed, the share skipped, the checkpoints the tree holds at the end and what those
state slots would cost at full size (docs/MODEL.md §8). The prompts diverge where a group's
shared prefix ends, with the second prompt of a group arriving after the first finished, so
the prefill an interval saves is the shared prefix up to the last interval multiple before it.
"""

from __future__ import annotations

import argparse
import types

import torch

from cli.bench_serving import make_workload
from glmrt.cache.layout import CacheLayout
from glmrt.checkpoint.presets import preset_config
from glmrt.engine.config import EngineConfig
from glmrt.engine.engine import Engine
from glmrt.sampling_params import SamplingParams


def workload(name: str, args) -> list[list[list[int]]]:
    ns = types.SimpleNamespace(dataset=name, endpoint="completions", seed=0, vocab_size=args.vocab,
                               input_len=args.input_len, shared_prefix_ratio=args.shared_ratio,
                               num_groups=args.num_groups, num_prompts=args.num_prompts,
                               num_turns=args.num_turns if name == "multi-turn" else 1, turn_len=args.turn_len)
    return [[(c.system or []) + c.messages[0]] + c.messages[1:] for c in make_workload(ns, 0)]


def run(engine: Engine, convs, out_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for conv in convs:
        prompt: list[int] = []
        for msg in conv:  # a turn's prompt: the previous prompt, its answer, the new message
            prompt = prompt + msg
            done = engine.generate([prompt], params)[0][0]
            prompt = prompt + done.output_ids
    c = engine.counters
    return {"prompt": c["prompt_tokens"], "computed": c["prompt_tokens"] - c["cached_prompt_tokens"],
            "checkpoints": engine.tree.stats()["checkpoints"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--shared-ratio", type=float, default=0.75)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--num-groups", type=int, default=4)
    ap.add_argument("--num-turns", type=int, default=3)
    ap.add_argument("--turn-len", type=int, default=128)
    ap.add_argument("--intervals", default="0,256,1024,4096,8192")
    ap.add_argument("--cache-gb", type=float, default=2.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.vocab = preset_config(args.preset).text.vocab_size
    full = CacheLayout.from_config(preset_config("flash").text)
    print(f"{'workload':13} {'interval':>8} {'prompt tok':>10} {'computed':>9} {'skipped':>8} "
          f"{'ckpts':>6} {'ckpt state @flash':>18}")
    for name in ("shared-prefix", "multi-turn"):
        convs = workload(name, args)
        for k in (int(x) for x in args.intervals.split(",")):
            e = Engine(EngineConfig(load_format="dummy", preset=args.preset, state_checkpoint_interval=k,
                                    cache_memory_gb=args.cache_gb), log=lambda *a: None)
            r = run(e, convs, args.output_len)
            gib = r["checkpoints"] * full.state_bytes_per_slot / 2**30
            print(f"{name:13} {k:>8} {r['prompt']:>10} {r['computed']:>9} "
                  f"{1 - r['computed'] / r['prompt']:>8.1%} {r['checkpoints']:>6} {gib:>15.1f} GiB")


if __name__ == "__main__":
    main()
