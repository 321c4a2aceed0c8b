"""`glmrt bench offline`: the in-process Engine on a shared-prefix workload, radix cache on vs off.

Workload: N prompts = one shared prefix of L random tokens + S random tokens of each prompt's
own, O greedy output tokens each (ignore_eos). Each run builds a fresh Engine (the weights are
loaded once and shared), prefills the shared prefix alone as an untimed warm-up request (as a
deployed system prompt would already be; it also leaves the state checkpoint at L that the
prefix cache resumes from), then times all N prompts submitted at once, run to completion.
The cache-off run (disable_radix_cache) does the same warm-up and so computes everything.
Both runs must give every request the same greedy tokens: an end-to-end check of the prefix
cache (KV page sharing + state checkpoint restore). Exit 1 when they differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "offline", help="the in-process engine on a shared-prefix workload, prefix cache on vs off",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", metavar="DIR", help="checkpoint directory (HF format)")
    m.add_argument("--preset", help="a named shape for --load-format dummy (tiny | flash-4l | flash-4l-mtp | flash)")
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights in device memory (with --preset, or --model for its config)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32, metavar="N")
    w.add_argument("--shared-prefix-len", type=int, default=256, metavar="L")
    w.add_argument("--suffix-len", type=int, default=32, metavar="S", help="each prompt's own tokens after the prefix")
    w.add_argument("--output-len", type=int, default=16, metavar="O")
    w.add_argument("--seed", type=int, default=0, help="prompt tokens and dummy weights")
    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=64)
    e.add_argument("--chunked-prefill-size", type=int, default=8192)
    e.add_argument("--max-running-requests", type=int)
    e.add_argument("--cache-memory-gb", type=float, default=0.25, help="CPU cache budget")
    e.add_argument("--device", default="auto")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--backend", default="auto")
    e.add_argument("--cpu-threads", type=int, default=0, metavar="N", help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")
    p.add_argument("--quiet", action="store_true", help="do not print the engines' boot lines")
    p.set_defaults(func=run)


class _Usage(ValueError):
    pass


def _check_args(args) -> None:
    for flag in ("num_prompts", "shared_prefix_len", "suffix_len", "output_len"):  # engine flags: EngineConfig
        if getattr(args, flag) < 1:
            raise _Usage(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.cpu_threads < 0:
        raise _Usage("--cpu-threads must be >= 0")
    if not args.model and not args.preset:
        raise _Usage("give --model DIR, or --preset NAME --load-format dummy")
    if args.model and args.preset:
        raise _Usage("--model and --preset both name the model: use one")
    if args.preset and args.load_format != "dummy":
        raise _Usage("--preset builds random weights: add --load-format dummy")


def _token_range(model_config) -> int:
    """Prompt tokens are drawn from [1, hi): below every special (eos, pad, image/video) id."""
    from glmrt.config import _TOKEN_ID_FIELDS

    t = model_config.text
    special = [*t.eos_token_id, *([t.pad_token_id] if t.pad_token_id is not None else [])]
    special += [getattr(model_config, k) for k in _TOKEN_ID_FIELDS]
    low = min([s for s in special if 1 < s < t.vocab_size], default=t.vocab_size)
    return low if low > 16 else t.vocab_size


def make_workload(num: int, prefix_len: int, suffix_len: int, hi: int, seed: int):
    g = random.Random(seed)
    prefix = [g.randrange(1, hi) for _ in range(prefix_len)]
    return prefix, [prefix + [g.randrange(1, hi) for _ in range(suffix_len)] for _ in range(num)]


def _prefixed(log, label: str):
    return lambda text: [log(f"[{label}] {line}") for line in str(text).splitlines()]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def time_run(engine, label: str, prefix, prompts, output_len: int) -> tuple[dict, list[list[int]]]:
    """Untimed warm-up (the shared prefix alone), then all prompts at once, timed to completion."""
    from glmrt.sampling_params import SamplingParams

    device = str(next(engine.model.parameters()).device)
    engine.generate([prefix], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    seconds = time.perf_counter() - t0
    engine.check_invariants()
    comps = [c[0] for c in outs]
    prompt_toks = sum(len(c.prompt_ids) for c in comps)
    output_toks = sum(len(c.output_ids) for c in comps)
    stats = {"run": label, "requests": len(comps), "prompt_tokens": prompt_toks,
             "cached_tokens": sum(c.cached_tokens for c in comps), "output_tokens": output_toks,
             "seconds": seconds, "prompt_tok_per_s": prompt_toks / seconds,
             "output_tok_per_s": output_toks / seconds, "total_tok_per_s": (prompt_toks + output_toks) / seconds,
             "retractions": engine.counters["retractions"],
             "max_running_requests": engine.memory.max_running_requests}
    return stats, [list(c.output_ids) for c in comps]


def format_table(runs: list[dict]) -> str:
    cols = [("run", "run", "{}"), ("requests", "requests", "{:d}"), ("prompt tok", "prompt_tokens", "{:d}"),
            ("cached tok", "cached_tokens", "{:d}"), ("output tok", "output_tokens", "{:d}"),
            ("seconds", "seconds", "{:.3f}"), ("prompt tok/s", "prompt_tok_per_s", "{:.1f}"),
            ("output tok/s", "output_tok_per_s", "{:.1f}"), ("total tok/s", "total_tok_per_s", "{:.1f}")]
    cells = [[h for h, _, _ in cols]] + [[f.format(r[k]) for _, k, f in cols] for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def run(args: argparse.Namespace) -> int:
    from glmrt.config_bounds import ConfigValueError, flag_spelling
    from glmrt.engine.config import EngineConfig

    try:
        _check_args(args)
        cfg_on = EngineConfig(model=args.model, preset=args.preset, load_format=args.load_format, dtype=args.dtype,
                              device=args.device, backend=args.backend, cache_memory_gb=args.cache_memory_gb,
                              max_running_requests=args.max_running_requests,
                              chunked_prefill_size=args.chunked_prefill_size,
                              max_prefill_tokens=max(16384, args.chunked_prefill_size),
                              page_size=args.page_size, seed=args.seed)
    except (_Usage, ConfigValueError) as e:
        msg = e.message(flag_spelling) if isinstance(e, ConfigValueError) else str(e)
        print(f"glmrt bench offline: error: {msg}", file=sys.stderr)
        return 2
    import torch

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)

    def log(line: str) -> None:
        if not args.quiet:
            print(line)
    cfg_off = cfg_on.replace(disable_radix_cache=True)
    n, lp, ls, lo = args.num_prompts, args.shared_prefix_len, args.suffix_len, args.output_len
    print(f"glmrt bench offline: {n} prompts = {lp} shared + {ls} own tokens, {lo} output tokens each "
          f"(greedy, ignore_eos); model {args.model or 'preset ' + args.preset} ({args.load_format})")
    from glmrt.engine.engine import Engine

    try:
        engine = Engine(cfg_on, log=_prefixed(log, "radix-on"))  # loads the weights once
        model, dtype = engine.model, str(engine.dtype).replace("torch.", "")
        device = str(next(model.parameters()).device)
        prefix, prompts = make_workload(n, lp, ls, _token_range(engine.model_config), args.seed)
        if lp + ls + lo > engine.context_length:
            raise ValueError(f"a request needs {lp + ls + lo} tokens; the context (and KV pool) holds "
                             f"{engine.context_length}: shorten the workload or raise --cache-memory-gb")
        on, out_on = time_run(engine, "radix-on", prefix, prompts, lo)
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        engine = Engine(cfg_off, model=model, log=_prefixed(log, "radix-off"))
        off, out_off = time_run(engine, "radix-off", prefix, prompts, lo)
        del engine
    except ValueError as e:  # config, memory plan, context length
        print(f"glmrt bench offline: error: {e}", file=sys.stderr)
        return 2
    diffs = []
    for i, (a, b) in enumerate(zip(out_on, out_off)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"request": i, "first_token": j, "radix_on": a, "radix_off": b})
    speedup = off["seconds"] / on["seconds"]
    print(f"device {device}, dtype {dtype}, page size {args.page_size}, "
          f"max_running_requests {on['max_running_requests']}")
    if not diffs:
        print(f"greedy outputs: identical for all {n} requests (radix cache on vs off)")
    else:
        d = diffs[0]
        print(f"greedy outputs: DIFFER for {len(diffs)} of {n} requests (first: request {d['request']}, "
              f"token {d['first_token']}: {d['radix_on'][d['first_token']:][:1]} vs "
              f"{d['radix_off'][d['first_token']:][:1]})")
    print(format_table([on, off]))
    print(f"speed-up (radix on / off): {speedup:.2f}x")
    if args.json:
        doc = {"workload": {"num_prompts": n, "shared_prefix_len": lp, "suffix_len": ls, "output_len": lo,
                            "seed": args.seed},
               "engine": {"model": args.model, "preset": args.preset, "load_format": args.load_format,
                          "device": device, "dtype": dtype, "page_size": args.page_size,
                          "chunked_prefill_size": args.chunked_prefill_size,
                          "max_running_requests": on["max_running_requests"],
                          "cache_memory_gb": args.cache_memory_gb},
               "runs": [on, off], "speedup": speedup, "outputs_identical": not diffs, "mismatches": diffs}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    return 0 if not diffs else 1
