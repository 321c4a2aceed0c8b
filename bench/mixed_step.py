"""A serving step's cost on one GPU: decodes alone, a prefill chunk alone, and both in one step.

    python3 -m bench.mixed_step [--preset flash-4l] [--decodes 64] [--context 1024]
                                [--chunks 1024,4096,8192,16384] [--reps 3] [--long 65536]

Through the real Engine (dummy weights, cuda-h200 kernels, decode CUDA graphs, no overlap
schedule so each step is timed alone: wall time of `engine.step()` between two device syncs):

  prefill    C new prompt tokens (prompts of `--prompt-len`, first tokens sampled), nothing
             else running
  decode     `--decodes` requests at `--context` tokens, one token each (the graph replay)
  mixed      the same decodes and C new prompt tokens in one step: what every running request
             waits for when prompts arrive (the serving workload's TPOT tail)

"mixed / sum" is the mixed step over prefill + decode run one after the other: under 1 the
step shares the weight reads of its two parts; over 1 it costs more than running them apart.
One profiled mixed step per chunk gives its kernel time and the host calls that wait for the
GPU (stream syncs, and copies from pageable host memory, which wait for the queue to drain); one
more under torch's sync debug mode says where in the code each wait is, and one under cProfile
where its host time goes (both printed for the first chunk).
`--long T`: one prompt of T tokens alone through the engine's chunked prefill
(`--chunked-prefill-size`), its useful TFLOP/s over 779 (bench.prefill_model's count).
Prints a short table last; JSON to $OUT/mixed_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.h200 import CEILING_TFLOPS, write_out
from bench.timing import as_engine_threads, host_profile, profile_events, wait_sites


def build(args):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    chunk = max(args.chunks)
    cfg = EngineConfig(load_format="dummy", preset=args.preset, backend="cuda-h200", page_size=64,
                       quantization=args.quantization, mem_fraction_static=args.mem_fraction,
                       max_running_requests=args.decodes + chunk // min(args.prompt_len, chunk), chunked_prefill_size=args.chunked_prefill_size,
                       max_prefill_tokens=chunk, skip_server_warmup=True, cuda_graph_warmup_tokens=0,
                       disable_overlap_schedule=True, load_vision=False,
                       context_length=max(args.long, chunk, args.context + args.steps_budget) + 64)
    return Engine(cfg, log=lambda *a: None)


class Prompts:
    def __init__(self, engine, seed: int = 0):
        self.vocab = engine.model_config.text.vocab_size - 200
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:  # random tokens: no prefix-cache hit between prompts
        return torch.randint(10, self.vocab, (n,), generator=self.g).tolist()


def timed_step(engine) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def one_token(engine, prompt: list[int]) -> str:
    from glmrt.sampling_params import SamplingParams

    return engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]


def arrivals(engine, prompts, tokens: int, prompt_len: int) -> list[str]:
    """`tokens` prompt tokens arriving at once, in prompts of `prompt_len` (one step takes them all)."""
    n = min(prompt_len, tokens)
    return [one_token(engine, prompts(n)) for _ in range(tokens // n)]


def prefill_alone(engine, prompts, tokens: int, prompt_len: int, reps: int) -> float:
    times = []
    for i in range(reps + 1):  # the first compiles and autotunes this size
        rids = arrivals(engine, prompts, tokens, prompt_len)
        ms = timed_step(engine)
        assert all(engine.requests.pop(r).finished for r in rids), "the prompts took more than one step"
        if i:
            times.append(ms)
    return statistics.median(times)


def start_decodes(engine, prompts, n: int, context: int, budget: int) -> list[str]:
    from glmrt.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    rids = [engine.add_request(prompts(context), params)[0] for _ in range(n)]
    while any(engine.requests[r].num_computed < context for r in rids):
        engine.step()
    for _ in range(3):
        engine.step()  # the decode graph of this batch captured and warm
    return rids


def mixed(engine, prompts, tokens: int, prompt_len: int, reps: int, decodes: list[str]) -> tuple[float, dict]:
    times = []
    for i in range(reps + 1):
        rids = arrivals(engine, prompts, tokens, prompt_len)
        before = {r: engine.requests[r].num_computed for r in decodes}
        ms = timed_step(engine)
        assert all(engine.requests.pop(r).finished for r in rids) and all(
            engine.requests[r].num_computed == before[r] + 1 for r in decodes), "not one mixed step"
        if i:
            times.append(ms)
    new: list[str] = []

    def step():
        new.extend(arrivals(engine, prompts, tokens, prompt_len))
        engine.step()
    prof = profile_events(step, reps=1, host=True)
    prof["wait_sites"] = wait_sites(step)
    prof["host"] = host_profile(step)
    assert all(engine.requests.pop(r).finished for r in new), "not one mixed step"
    return statistics.median(times), prof


def long_prompt(engine, prompts, tokens: int) -> dict:
    from bench.prefill_model import useful_flops

    for _ in range(2):  # the first pass compiles the chunk shapes it meets
        rid = one_token(engine, prompts(tokens))
        torch.cuda.synchronize()
        steps, t = 0, time.perf_counter()
        while not engine.requests[rid].finished:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        engine.requests.pop(rid)
    flops = useful_flops(engine.model, tokens)["total"]
    return {"tokens": tokens, "chunk": engine.config.chunked_prefill_size, "steps": steps, "ms": ms,
            "tflops": flops / ms / 1e9, "pct_ceiling": 100 * flops / ms / 1e9 / CEILING_TFLOPS}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--quantization", default=None, help="fp8: block-scaled e4m3 weights (default: bf16)")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunks", default="1024,4096,8192,16384", help="prompt tokens arriving in one step")
    p.add_argument("--prompt-len", type=int, default=1024, help="the length of each arriving prompt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--long", type=int, default=0, help="one prompt of this many tokens through chunked prefill")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    args = p.parse_args(argv)
    as_engine_threads()  # host work timed as an engine actor does it
    args.chunks = [int(x) for x in args.chunks.split(",") if x]
    args.steps_budget = 16 * (args.reps + 2) * (len(args.chunks) + 1) + 64
    engine = build(args)
    prompts = Prompts(engine)
    out = {"preset": args.preset, "quantization": args.quantization, "decodes": args.decodes,
           "context": args.context, "rows": []}
    if args.long:
        out["long"] = long_prompt(engine, prompts, args.long)
    alone = {c: prefill_alone(engine, prompts, c, args.prompt_len, args.reps) for c in args.chunks}
    decodes = start_decodes(engine, prompts, args.decodes, args.context, args.steps_budget)
    dec = statistics.median(timed_step(engine) for _ in range(5 * args.reps))
    for c in args.chunks:
        ms, prof = mixed(engine, prompts, c, args.prompt_len, args.reps, decodes)
        out["rows"].append({"chunk": c, "prefill_ms": alone[c], "decode_ms": dec, "mixed_ms": ms,
                            "mixed_over_sum": ms / (alone[c] + dec), "kernels_ms": prof["kernel_us"] / 1e3,
                            "syncs": prof["syncs"], "h2d_copies": prof["h2d_copies"], "wait_sites": prof["wait_sites"],
                            "host_profile": prof["host"]})
    for r in decodes:
        engine.abort(r)
    write_out("mixed_step.json", out)
    print(f"\n{args.preset} ({args.quantization or 'bf16'}), {args.decodes} decodes at {args.context} tokens, "
          f"step wall ms (median of {args.reps}):")
    print("| prompt tokens | prefill alone | decode | sum | mixed | mixed / sum | mixed kernels | syncs | H2D copies |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        s = r["prefill_ms"] + r["decode_ms"]
        print(f"| {r['chunk']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {s:.1f} | {r['mixed_ms']:.1f} | "
              f"{r['mixed_over_sum']:.2f} | {r['kernels_ms']:.1f} | {r['syncs']} | {r['h2d_copies']} |")
    for r in out["rows"][:1]:
        print(f"\nwhere the mixed step of {r['chunk']} prompt tokens waits for the GPU (count, innermost frames):")
        for site, n in r["wait_sites"].items():
            print(f"  {n:3d}  {site}")
        print("its host time by function under cProfile (own ms, cumulative ms, calls):")
        for own, cum, calls, where in r["host_profile"]:
            print(f"  {own:7.2f} {cum:8.2f} {calls:6d}  {where}")
    if "long" in out:
        lg = out["long"]
        print(f"\none prompt of {lg['tokens']} tokens in {lg['steps']} chunks of {lg['chunk']}: {lg['ms']:.0f} ms, "
              f"{lg['tflops']:.0f} TFLOP/s = {lg['pct_ceiling']:.1f}% of {CEILING_TFLOPS:.0f}")
    return out


if __name__ == "__main__":
    main()
