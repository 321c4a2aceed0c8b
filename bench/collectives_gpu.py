"""The collectives of glmrt's tensor parallelism, timed: the file `bench.projection --collectives` reads.

    torchrun --nproc-per-node 4 -m bench.collectives_gpu [--tokens 1,16,64,128,768] [--reps 50]
    torchrun --nproc-per-node 2 -m bench.collectives_gpu --smoke      # the CPU, gloo: checks it runs

One process per GPU, NCCL, through `glmrt.parallel.Parallel` (the calls a decode step makes):
the all-reduce of tokens x hidden bf16 (attention output, MoE sum, embedding: 2 x layers + 1 a
forward) and the all-gather of tokens x vocab / n bf16 logits along the vocab. On CUDA each size
is captured as a CUDA graph of --reps back-to-back calls, as the decode graph holds them, and a
call's time is the median replay over --reps, the slowest rank's. Rank 0 writes
$OUT/collectives_<n>.json: {"ranks": n, "allreduce": [[bytes, us], ...], "all_gather": [[bytes
in all, us], ...]}. Without CUDA (--smoke) the calls run on gloo and are host-timed: a check that
the driver runs, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from glmrt.parallel import Parallel


def _time_us(fn, reps: int, cuda: bool) -> float:
    """Median time of one call of fn (which makes `reps` calls)."""
    if cuda:
        from bench.timing import replay_ms

        fn()  # warm: NCCL sets up its channels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return replay_ms(graph) * 1e3 / reps
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6 / reps)
    return statistics.median(times)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m bench.collectives_gpu")
    p.add_argument("--tokens", default="1,16,64,128,256,768")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=154880)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="gloo on the CPU, 2 reps: checks that it runs")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.exit(2, "collectives_gpu: start it with torchrun --nproc-per-node N (N >= 2)\n")
    tokens = [int(x) for x in args.tokens.split(",")]
    cuda = torch.cuda.is_available() and not args.smoke
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if n < 2 or args.vocab % n or any(t < 1 for t in tokens) or args.reps < 1:
        p.exit(2, f"collectives_gpu: needs >= 2 ranks, a vocab divisible by {n}, positive --tokens and --reps\n")
    reps = 2 if args.smoke else args.reps
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    par = Parallel(rank=rank, tp_size=n, ep_size=1, group=dist.group.WORLD)
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    rows = {"allreduce": [], "all_gather": []}
    for t in tokens:
        x = torch.zeros(t, args.hidden, dtype=dtype, device=dev)
        rows["allreduce"].append((x.numel() * 2, _time_us(lambda: [par.all_reduce(x) for _ in range(reps)],
                                                          reps, cuda)))
        part = torch.zeros(t, args.vocab // n, dtype=dtype, device=dev)
        rows["all_gather"].append((t * args.vocab * 2, _time_us(lambda: [par.all_gather(part, -1)
                                                                         for _ in range(reps)], reps, cuda)))
    times = torch.tensor([us for kind in rows.values() for _, us in kind], dtype=torch.float64,
                         device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
    it = iter(times.tolist())
    out = {"ranks": n, **{k: [[size, next(it)] for size, _ in v] for k, v in rows.items()}}
    dist.destroy_process_group()
    if rank != 0:
        return None
    from bench.h200 import write_out

    path = write_out(f"collectives_{n}.json", out)
    print(json.dumps(out))
    print(f"{'kind':>10} {'bytes':>11} {'us':>8}" + (f"   -> {path}" if path else ""))
    for kind, pts in out.items():
        if kind != "ranks":
            for size, us in pts:
                print(f"{kind:>10} {size:>11,} {us:>8.1f}")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
