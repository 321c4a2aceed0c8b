"""Speculative decoding (the MTP layer's chain) on the GPU: tokens against the reference backend,
acceptance and decode speed against no speculation.

    python3 -m bench.speculative [--preset flash-4l-mtp] [--steps 1,3,5] [--batches 1,16]
                                 [--prompt-len 256] [--output-len 64] [--model DIR]
                                 [--backend cuda-h200] [--compare reference] [--device cuda]
                                 [--prompts random|chats] [--profile N] [--short-rows chunk,recurrent]

Each engine is built alone (random weights of the preset by `--load-format dummy`, or `--model`),
runs the same greedy prompts, and is freed before the next: `cuda-h200` without speculation,
the same without CUDA graphs (what a speculating step without graphs is held to: a sampled
step, more than one rank), then with each K of `--steps` (greedy steps on one rank replay the
speculative CUDA graphs), then the `reference` backend (bf16 torch on the same GPU) with the
largest K. Printed per run: decode tokens per second per batch size, the mean accepted length
and the acceptance rate per draft position, the draft and verify milliseconds per step (a
graphed step counts its whole cycle as verify; `bench.spec_cycle` times its parts), and the
share of output tokens equal to the `cuda-h200` run without speculation (bf16 noise flips a few near
ties; a rollback bug makes whole requests diverge). Random weights draft badly, so the accepted
length here measures the machinery; a trained checkpoint (`--model`) measures acceptance. JSON to
$OUT/speculative.json when OUT is set.

--prompts chats (with --model: the checkpoint's tokenizer.json) takes the prompts from the
held-out chats of the training corpus (glmrt.train.corpus.held_out_chats, what `glmrt bench
serving --dataset chats` sends), rendered by glmrt's chat template with thinking on, as the
tokenizer actor renders them; each request then runs until the model stops (at most
--output-len tokens) and tokens/s counts the tokens generated.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

import torch

from bench.h200 import write_out
from bench.timing import as_engine_threads


def set_short_rows(mode: str) -> None:
    """How `cuda-h200` runs batches of short rows (the verify and the rollback): "recurrent" (the
    default: fla's fused_recurrent in place, the indexer's pool grid bounded by the row count),
    "chunk" (the earlier path: chunk_kda with gathered states; the indexer grid from the prefix
    lengths, eager only)."""
    from backends.kernels import indexer, kda

    kda.RECURRENT_MAX_TOKENS = 8 if mode == "recurrent" else 0
    indexer.SHORT_ROWS_MAX = 8 if mode == "recurrent" else 1


def run_engine(args, backend: str, steps: int, prompts: list[list[int]], graphs: bool = True,
               short_rows: str | None = None) -> dict:
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams

    kw = dict(model=args.model, load_format="auto") if args.model else dict(preset=args.preset, load_format="dummy")
    if steps:
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=steps)
    e = Engine(EngineConfig(backend=backend, device=args.device, page_size=64, skip_server_warmup=True,
                            disable_cuda_graph=not graphs, **kw), log=lambda *a: None)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=args.prompts == "random")
    e.generate([prompts[0]], params)  # warm: compile the kernels of each shape once
    out = {"backend": backend + ("" if graphs else "/eager") + (f"/{short_rows}" if short_rows else ""),
           "steps": steps, "batches": {}}
    for b in args.batches:
        batch = prompts[:b]
        e.generate(batch, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # prefill (cached)
        before = e.spec.stats.as_dict() if e.spec else {}
        sync()
        prof = cProfile.Profile() if args.profile and steps == max(args.steps) and b == args.batches[0] \
            and backend == args.backend else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        done = e.generate(batch, params)
        sync()
        took = time.perf_counter() - t0
        if prof:
            prof.disable()
            out["profile"] = f"{backend} K={steps} batch {b}, " + profile_text(prof, args.profile)
        outputs = [c[0].output_ids for c in done]
        # the first token of each request comes from the prefill, not from decoding
        row = {"tokens_per_s": sum(len(o) - 1 for o in outputs) / took, "outputs": outputs,
               "output_tokens": sum(len(o) for o in outputs)}
        if e.spec:
            after = e.spec.stats.as_dict()
            d = {k: after[k] - before.get(k, 0) for k in after}
            cyc, st = d["spec_cycles"], d["spec_steps"]
            row.update(mean_accepted_length=d["spec_emitted_tokens"] / cyc if cyc else 0.0,
                       acceptance_rate=[d[f"spec_accepted_at_{i}"] / d[f"spec_drafted_at_{i}"]
                                        if d[f"spec_drafted_at_{i}"] else 0.0 for i in range(steps)],
                       draft_ms=1000 * d["spec_draft_seconds"] / st if st else 0.0,
                       verify_ms=1000 * d["spec_verify_seconds"] / st if st else 0.0)
        out["batches"][b] = row
    del e
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def teacher_forced(args, prompts: list[list[int]], runs: list[dict]) -> None:
    """Each run's outputs scored by one forward of `--compare` without speculation over prompt +
    output: per row, the share of output tokens that are that forward's top-1 (and within its
    top 5) at their position ("forced top-1"). Teacher forcing keeps one near tie that bf16 noise
    flips from diverging the rest of the request (what "same tokens" counts); a state bug makes
    the tokens after it wrong under the scorer too. Random weights have near ties everywhere, so
    this is the check that holds there."""
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.engine.ranks import ForwardInputs

    kw = dict(model=args.model, load_format="auto") if args.model else dict(preset=args.preset, load_format="dummy")
    e = Engine(EngineConfig(backend=args.compare, device=args.device, page_size=64, skip_server_warmup=True,
                            disable_cuda_graph=True, **kw), log=lambda *a: None)
    for r in runs:
        for b, row in r["batches"].items():
            top1 = top5 = total = 0
            for prompt, out in zip(prompts[:b], row["outputs"]):
                ids = prompt + out
                pages, slot = e.pages.allocate(-(-len(ids) // 64)), e.slots.allocate()
                try:
                    logits = e.runner.run(ForwardInputs(ids=ids, prefix_lens=[0], seq_lens=[len(ids)],
                                                        slot_ids=[slot], page_tables=[pages],
                                                        logits_rows=list(range(len(prompt) - 1, len(ids) - 1))))
                    top = logits.float().topk(5, dim=-1).indices.cpu()
                finally:
                    e.pages.release(pages)
                    e.slots.free(slot)
                want = torch.tensor(out, dtype=top.dtype)
                top1 += int((top[:, 0] == want).sum())
                top5 += int((top == want[:, None]).any(dim=1).sum())
                total += len(out)
            row["forced_top1"], row["forced_top5"] = top1 / max(1, total), top5 / max(1, total)
    del e
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_text(prof: cProfile.Profile, n: int) -> str:
    """The n host functions of most own time, then glmrt's own by time including callees."""
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    text.write("host functions by own time:\n")
    st.sort_stats("tottime").print_stats(n)
    text.write("the same, glmrt's own functions by time including callees:\n")
    st.sort_stats("cumulative").print_stats(r"glmrt/|backends/", n)
    return text.getvalue()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / max(1, sum(len(r) for r in a))


def chat_prompts(args, count: int) -> list[list[int]]:
    """The first `count` held-out corpus chats, as the token ids the tokenizer actor sends."""
    import os

    from tokenizers import Tokenizer

    from glmrt.serving.chat_template import render_chat
    from glmrt.train.corpus import held_out_chats

    tok = Tokenizer.from_file(os.path.join(os.path.expanduser(args.model), "tokenizer.json"))
    return [tok.encode(render_chat(c.messages[:-1], c.tools, thinking=True), add_special_tokens=False).ids
            for c in held_out_chats(0, count)]


def main() -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.speculative")
    p.add_argument("--preset", default="flash-4l-mtp")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of the preset's random weights")
    p.add_argument("--steps", default="1,3,5")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--backend", default="cuda-h200", help="the kernel set measured")
    p.add_argument("--compare", default="reference", help="the kernel set whose tokens it is held to")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", choices=("random", "chats"), default="random",
                   help="random: --prompt-len random ids, --output-len tokens each; chats: the held-out "
                        "corpus chats (needs --model), each until the model stops")
    p.add_argument("--profile", type=int, default=0, help="print the N host functions of most own time in the "
                   "largest K's first batch on --backend (cProfile; time waiting on the GPU lands on the syncs)")
    p.add_argument("--short-rows", default="", help="chunk,recurrent: the speculative rows on --backend once per "
                   "way of running the verify's and rollback's short rows (bench.speculative.set_short_rows)")
    args = p.parse_args()
    as_engine_threads()  # host work timed as an engine actor does it
    if any(m not in ("chunk", "recurrent") for m in filter(None, args.short_rows.split(","))):
        p.error("--short-rows takes chunk and/or recurrent")
    if args.prompts == "chats" and not args.model:
        p.error("--prompts chats needs --model (a checkpoint with its tokenizer.json)")
    if args.prompts == "chats" and any(a.startswith("--prompt-len") for a in sys.argv[1:]):
        p.error("--prompt-len does not apply to --prompts chats")
    args.steps = [int(x) for x in args.steps.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.prompts == "chats":
        prompts = chat_prompts(args, max(args.batches))
    else:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, 1000, (max(args.batches), args.prompt_len), generator=g).tolist()
    runs = [run_engine(args, args.backend, 0, prompts)]
    if args.device == "cuda":  # the plain decode step without graphs: what an eager speculative step is held to
        runs.append(run_engine(args, args.backend, 0, prompts, graphs=False))
    modes = args.short_rows.split(",") if args.short_rows else [None]
    for mode in modes:
        if mode is not None:
            set_short_rows(mode)
        runs += [run_engine(args, args.backend, k, prompts, short_rows=mode if len(modes) > 1 else None)
                 for k in args.steps]
    set_short_rows("recurrent")
    runs.append(run_engine(args, args.compare, max(args.steps), prompts))
    teacher_forced(args, prompts, runs)
    base = runs[0]["batches"]
    for r in runs:
        if "profile" in r:
            print(r.pop("profile"))
    print(f"{'backend':<10} {'K':>2} {'batch':>5} {'tok/s':>9} {'speed-up':>8} {'accepted':>8} "
          f"{'draft ms':>8} {'verify ms':>9} {'same tokens':>11} {'forced top-1':>12} {'top-5':>6}  "
          "acceptance per position")
    for r in runs:
        for b, row in r["batches"].items():
            row["same_tokens"] = agreement(base[b]["outputs"], row["outputs"])
            row["speed_up"] = row["tokens_per_s"] / base[b]["tokens_per_s"]
            rates = " ".join(f"{x:.2f}" for x in row.get("acceptance_rate", []))
            print(f"{r['backend']:<10} {r['steps']:>2} {b:>5} {row['tokens_per_s']:>9.1f} {row['speed_up']:>8.2f} "
                  f"{row.get('mean_accepted_length', 1.0):>8.2f} {row.get('draft_ms', 0):>8.2f} "
                  f"{row.get('verify_ms', 0):>9.2f} {100 * row['same_tokens']:>10.1f}% "
                  f"{100 * row['forced_top1']:>11.1f}% {100 * row['forced_top5']:>5.1f}%  {rates}")
    for r in runs:
        for row in r["batches"].values():
            row.pop("outputs")
    write_out("speculative.json", {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
