"""The speculative cycle's GPU time on one rank, part by part, against the plain decode step.

    python3 -m bench.spec_cycle [--model DIR | --preset flash-4l-mtp] [--steps 1,3,5]
                                [--batches 1,16,64] [--context 512] [--backend cuda-h200]

One engine without speculation, then one per K, each built alone. Per batch size, `--batches`
requests are prefilled with `--context` random tokens (the draft layer over them too), then the
graphs a decode step would replay are timed (event-timed replays, median, after a second of warm
replays): the plain decode step (glmrt.engine.cuda_graphs), and of the speculative step
(glmrt.engine.spec_graphs) the draft chain (K steps of the MTP layer) and the verify (the model
over K + 1 rows, the draft layer over the same rows) each captured on its own, the serving
cycle graph (both in one), and the rollback graph. Only GPU time: the host's share of a cycle is
what `bench.speculative` measures end to end beside it.

"break-even": the tokens a cycle must keep on average to match the plain step, (cycle +
rollback) / plain step; the speed-up of a decode is at most accepted / break-even. Prints a
short table last; JSON to $OUT/spec_cycle.json when OUT is set. `--kernels N` first prints, for
the first K and batch, the N kernels of most GPU time in each graph (torch.profiler over a few
replays): where a part's time goes.
"""

from __future__ import annotations

import argparse
import gc

import torch

from bench.h200 import write_out
from bench.timing import profile_events, replay_ms


def build(args, steps: int):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    kw = dict(model=args.model, load_format="auto") if args.model else dict(preset=args.preset, load_format="dummy")
    if steps:
        kw.update(speculative_algorithm="EAGLE", speculative_num_steps=steps)
    return Engine(EngineConfig(backend=args.backend, device="cuda", page_size=args.page_size, skip_server_warmup=True,
                               cuda_graph_warmup_tokens=0, **kw), log=lambda *a: None)


def prefill(e, batch: int, context: int, extra: int, g: torch.Generator) -> tuple[list[tuple[list[int], int]], list[int]]:
    """`batch` requests of `context` random tokens, prefilled -> ((pages, slot) of each, with room
    for `extra` more positions; a random next token of each: rows that route alike would reach
    fewer experts than a real batch)."""
    from glmrt.engine.ranks import ForwardInputs

    ps = e.config.page_size
    vocab = e.runner.model.config.text.vocab_size
    reqs = []
    for _ in range(batch):
        ids = torch.randint(10, min(vocab, 1000) - 10, (context,), generator=g).tolist()
        pages, slot = e.pages.allocate(-(-(context + extra) // ps)), e.slots.allocate()
        e.runner.run(ForwardInputs(ids=ids, prefix_lens=[0], seq_lens=[context], slot_ids=[slot],
                                   page_tables=[pages], logits_rows=[context - 1]))
        reqs.append((pages, slot))
    torch.cuda.synchronize()
    return reqs, torch.randint(10, min(vocab, 1000) - 10, (batch,), generator=g).tolist()


def release(e, reqs) -> None:
    for pages, slot in reqs:
        e.pages.release(pages)
        e.slots.free(slot)


def kernel_table(name: str, graph: torch.cuda.CUDAGraph, top: int, replays: int = 5) -> str:
    """The `top` kernels of most GPU time in one replay of `graph`, and its kernel count."""
    prof = profile_events(graph.replay, reps=replays)
    lines = [f"{name}: {prof['launches']:.0f} kernels a replay, {prof['kernel_us']:.0f} us of kernel time"]
    lines += [f"  {us:8.1f} us  {n:5.1f}x  {k[:100]}" for k, (us, n) in list(prof["kernels"].items())[:top]]
    return "\n".join(lines)


def plain_rows(args) -> dict[int, float]:
    e = build(args, 0)
    g, out = torch.Generator().manual_seed(0), {}
    dg = e.runner.graphs
    for b in args.batches:
        reqs, nxt = prefill(e, b, args.context, 2, g)
        key = dg.key(b, args.context // e.config.page_size + 1)
        dg.run(key, nxt, [args.context] * b, [s for _, s in reqs], [p for p, _ in reqs])
        out[b] = replay_ms(dg.graphs[key][0], n=args.replays, warm_s=1.0)
        if args.kernels and b == args.batches[0]:
            print(kernel_table(f"plain decode step, batch {b}", dg.graphs[key][0], args.kernels))
        release(e, reqs)
    del e, dg
    free()
    return out


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn captured on its own (its kernels already compiled and tuned by the serving graphs' capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        fn()
    return graph


def spec_rows(args, steps: int) -> dict[int, dict]:
    e = build(args, steps)
    sg = e.runner.spec_graphs
    if sg is None:
        raise SystemExit("this engine speculates eagerly (no speculative CUDA graphs): nothing to time")
    g, out = torch.Generator().manual_seed(0), {}
    for b in args.batches:
        reqs, nxt = prefill(e, b, args.context, steps + 2, g)
        key = sg.key(b, args.context + steps)
        if key is None:
            print(f"K={steps} batch {b}: past the largest speculative graph (batch {sg.max_bs}); skipped")
            release(e, reqs)
            continue
        bs, pages = key
        sg.run(key, nxt, [args.context] * b, [s for _, s in reqs],
               [e.rollback_base + i for i in range(b)], [p for p, _ in reqs])
        cycle, rollback, _, cap = sg.graphs[key]
        drafts = []
        draft = captured(lambda: drafts.append(sg.draft_chain(bs, pages)))
        verify = captured(lambda: sg.verify(bs, pages, drafts[0]))
        row = {name: replay_ms(graph, n=args.replays, warm_s=1.0)
               for name, graph in (("draft_ms", draft), ("verify_ms", verify), ("cycle_ms", cycle),
                                   ("rollback_ms", rollback))}
        row["graph_batch"] = bs
        if args.kernels and b == args.batches[0] and steps == args.steps[0]:
            for name, graph in (("draft chain", draft), ("verify", verify), ("rollback", rollback)):
                print(kernel_table(f"{name}, K={steps} batch {b}", graph, args.kernels))
        out[b] = row
        del draft, verify, drafts, cycle, rollback, cap
        release(e, reqs)
    del e, sg
    free()
    return out


def free() -> None:
    """The engine just dropped: its memory back before the next one sizes its pools."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(prog="python3 -m bench.spec_cycle")
    p.add_argument("--preset", default="flash-4l-mtp")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of the preset's random weights")
    p.add_argument("--steps", default="1,3,5")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--backend", default="cuda-h200")
    p.add_argument("--kernels", type=int, default=0, help="print the N kernels of most time in each graph")
    args = p.parse_args()
    args.steps = [int(x) for x in args.steps.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench.spec_cycle times CUDA graphs: it needs a CUDA device")
    if any(k < 1 or k + 2 > args.page_size for k in args.steps):
        raise SystemExit(f"--steps: each K from 1 to {args.page_size - 2} (speculative graphs need page_size > K + 1)")
    plain = plain_rows(args)
    spec = {k: spec_rows(args, k) for k in args.steps}
    print(f"{'K':>2} {'batch':>5} {'plain ms':>8} {'(K+1) plain':>11} {'draft ms':>8} {'per draft':>9} "
          f"{'verify ms':>9} {'verify/plain':>12} {'cycle ms':>8} {'rollback':>8} {'/(K+1) plain':>12} {'break-even':>10}")
    for k, rows in spec.items():
        for b, r in rows.items():
            pl = plain[b]
            whole = r["cycle_ms"] + r["rollback_ms"]
            r.update(plain_ms=pl, vs_k1_plain=whole / ((k + 1) * pl), break_even=whole / pl)
            print(f"{k:>2} {b:>5} {pl:>8.3f} {(k + 1) * pl:>11.3f} {r['draft_ms']:>8.3f} {r['draft_ms'] / k:>9.3f} "
                  f"{r['verify_ms']:>9.3f} {r['verify_ms'] / pl:>12.2f} {r['cycle_ms']:>8.3f} {r['rollback_ms']:>8.3f} "
                  f"{r['vs_k1_plain']:>12.2f} {r['break_even']:>10.2f}")
    write_out("spec_cycle.json", {"args": vars(args), "plain_ms": plain, "spec": spec})


if __name__ == "__main__":
    main()
