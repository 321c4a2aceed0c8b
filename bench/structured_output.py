"""The cost of structured output per decode step: one batch constrained by a grammar vs the same
batch unconstrained, paired, through the real Engine.

    python3 -m bench.structured_output                          # CPU: the tiny preset, batch 8
    python3 -m bench.structured_output --preset flash-4l --batch 64 --backend cuda-h200
    python3 -m bench.structured_output --smoke                   # a quick run that checks it works

One engine (dummy weights; a byte-level tokenizer of the preset's vocabulary written to a tmp
dir, since dummy weights come without a checkpoint), B requests of P prompt tokens decoding T
tokens at temperature 1, run `--pairs` times each way, alternating:

  off      no grammar (the overlap schedule runs where the engine has it on)
  json     every request under a JSON schema that cannot end before T tokens (a log of at
           least 10000 objects {id: integer, msg: string}); matcher fill + mask every step
  regex    every request under `([a-z]+ )*` ... (a cheap grammar: the mask's fixed cost)
  mixed    half the batch under the JSON schema, half free (the batch runs synchronously)

Per mode: the median decode step (ms, the steps where all B rows decode), output tokens per
second over the whole run, the host time of the mask fill per step, and the step's overhead
against "off" of the same pair. Every constrained answer is checked to be a prefix the grammar
accepts (its matcher never broke). A short table is printed last; JSON to
$OUT/structured_output.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.h200 import write_out  # noqa: E402

LOG_SCHEMA = {"type": "object", "properties": {"log": {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "msg": {"type": "string"}},
    "required": ["id", "msg"], "additionalProperties": False}}}, "required": ["log"], "additionalProperties": False}
WORDS = "([a-z]+ )*[a-z]+ [a-z]+ [a-z]+ [a-z]+ [a-z]+"


def _engine(args):
    from glmrt.checkpoint.tokenizer import write_tokenizer
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.engine.structured import StructuredOutput

    cuda = torch.cuda.is_available() and args.backend != "reference"
    cfg = EngineConfig(load_format="dummy", preset=args.preset, backend=args.backend, page_size=64,
                       max_running_requests=args.batch, load_vision=False,
                       context_length=args.prompt + args.tokens + 64,
                       **({"mem_fraction_static": 0.85} if cuda else {"cache_memory_gb": 1.0}))
    engine = Engine(cfg, log=lambda *a: None)
    vocab = engine.model_config.text.vocab_size
    tmp = tempfile.mkdtemp(prefix="glmrt-bench-tok-")
    write_tokenizer(tmp, vocab)
    engine.runner.structured = StructuredOutput(str(Path(tmp) / "tokenizer.json"), vocab, engine.eos_ids)
    return engine


def _run(engine, args, mode: str, seed: int) -> dict:
    from glmrt.sampling_params import Grammar, SamplingParams

    so = engine.runner.structured
    json_g = Grammar("json_schema", json.dumps(LOG_SCHEMA))
    grammar_of = {"off": lambda i: None, "json": lambda i: json_g, "regex": lambda i: Grammar("regex", WORDS),
                  "mixed": lambda i: json_g if i % 2 == 0 else None}[mode]
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.text.vocab_size
    rids = []
    for i in range(args.batch):
        prompt = torch.randint(10, min(vocab, 900), (args.prompt,), generator=g).tolist()
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.tokens, ignore_eos=grammar_of(i) is None,
                                seed=seed * 1000 + i)
        rids += engine.add_request(prompt, params, grammar=grammar_of(i))
    fill_s = [0.0]
    fill = so.fill

    def timed_fill(reqs):
        t = time.perf_counter()
        out = fill(reqs)
        fill_s[0] += time.perf_counter() - t
        return out

    so.fill = timed_fill
    steps, t_start = [], time.perf_counter()
    try:
        while engine.has_work():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            engine.step()
            decoding = len(engine.scheduler.running) == args.batch and not engine.scheduler.waiting
            steps.append((time.perf_counter() - t, decoding))
    finally:
        so.fill = fill
    total = time.perf_counter() - t_start
    reqs = [engine.requests.pop(r) for r in rids]
    out_tokens = sum(len(r.output_ids) for r in reqs)
    broken = [r.rid for r in reqs if r.rid in so.constraints and so.constraints[r.rid].broken]
    decode_steps = [s for s, d in steps[1:] if d] or [s for s, _ in steps]
    return {"mode": mode, "step_ms": 1e3 * statistics.median(decode_steps), "tok_s": out_tokens / total,
            "fill_ms_per_step": 1e3 * fill_s[0] / max(1, len(steps)), "steps": len(steps), "tokens": out_tokens,
            "broken": broken, "finish": sorted({r.finish_reason for r in reqs})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="model preset (default: flash-4l on CUDA, tiny on the CPU)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--batch", type=int, default=None, help="requests per batch (default: 64 on CUDA, 8 on the CPU)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--modes", default="json,regex,mixed")
    p.add_argument("--smoke", action="store_true", help="tiny preset, batch 4, 8 tokens, one pair")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.preset, args.batch, args.tokens, args.prompt, args.pairs = "tiny", 4, 8, 16, 1
    args.preset = args.preset or ("flash-4l" if cuda else "tiny")
    args.batch = args.batch or (64 if cuda else 8)
    if not cuda:
        torch.set_num_threads(1)
    engine = _engine(args)
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[dict]] = {m: [] for m in ["off", *modes]}
    _run(engine, args, "off", seed=999)  # warm-up (graphs, kernels, the grammar compile)
    for m in modes:
        _run(engine, args, m, seed=998)
    for pair in range(args.pairs):
        for m in ["off", *modes]:
            results[m].append(_run(engine, args, m, seed=pair))
    rows = []
    base = statistics.median(r["step_ms"] for r in results["off"])
    for m, runs in results.items():
        step = statistics.median(r["step_ms"] for r in runs)
        paired = [r["step_ms"] / o["step_ms"] - 1 for r, o in zip(runs, results["off"])]
        rows.append({"mode": m, "batch": args.batch, "step_ms": step, "tok_s": statistics.median(r["tok_s"] for r in runs),
                     "fill_ms": statistics.median(r["fill_ms_per_step"] for r in runs),
                     "overhead_pct": 100 * statistics.median(paired) if m != "off" else 0.0,
                     "broken": sum(len(r["broken"]) for r in runs), "finish": runs[-1]["finish"]})
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"\nstructured output, {args.preset} on {engine.backend.name} ({device}), batch {args.batch}, "
          f"prompt {args.prompt}, {args.tokens} tokens, {args.pairs} pairs; off: median step {base:.2f} ms")
    print(f"{'mode':<8}{'step ms':>9}{'tok/s':>10}{'fill ms':>9}{'overhead':>10}  finish")
    for r in rows:
        print(f"{r['mode']:<8}{r['step_ms']:>9.2f}{r['tok_s']:>10.1f}{r['fill_ms']:>9.3f}{r['overhead_pct']:>9.1f}%  "
              f"{','.join(r['finish'])}{'  BROKEN ' + str(r['broken']) if r['broken'] else ''}")
    write_out("structured_output.json", {"args": vars(args), "device": device, "rows": rows, "runs": results})
    if any(r["broken"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
