"""Decode CUDA graphs and the overlap schedule on one GPU, through the real Engine.

    python3 -m bench.decode_overlap [--preset flash-4l] [--batches 1,16,64] [--context 1024] [--tokens 48]
                                    [--sampling greedy,temperature=0.7:top_k=50:top_p=0.9] [--split-gather on,off]

One engine (dummy weights, cuda-h200 kernels), three ways to run the same decode workload:

  eager     no graphs, no overlap: every step launches its kernels from Python, then waits
  graphs    decode replayed from CUDA graphs, the host waits for each step's tokens
  overlap   graphs + the overlap schedule: step N+1 is scheduled and launched before step
            N's tokens are read, so the CPU work hides behind the GPU

Checks first: the graph's logits equal the eager forward's on the same cache state (bf16
bound), greedy tokens of the three modes agree, and the overlapped launch makes no host
synchronisation (torch.cuda.set_sync_debug_mode("error") around it). Then per batch the
decode step time (wall time of the decode phase / steps) of each mode, the GPU-only time of
one graph replay, and the host time per step. `--sampling` runs the workload once per
sampling setting (greedy: one argmax; else SamplingParams fields, each request seeded, so the
modes draw the same tokens), `--split-gather` once per on-GPU sampler path (on: the split
gather and the narrow sort of small brackets; off: the select kernel's one-program gather and
whole-buffer sort): the step time difference is what sampling costs. A short table is printed
last; JSON to $OUT/decode_overlap.json when OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from bench.h200 import CEILING_TBPS, write_out
from bench.timing import as_engine_threads, replay_ms


def _engine(args):
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    cfg = EngineConfig(load_format="dummy", preset=args.preset, backend="cuda-h200", page_size=64,
                       quantization=args.quantization,
                       mem_fraction_static=args.mem_fraction, max_running_requests=max(args.batch_list),
                       load_vision=False, context_length=args.context + args.tokens + 64)
    return Engine(cfg, log=lambda *a: print(*a, flush=True))


def _prompts(engine, b: int, ctx: int, seed: int) -> list[list[int]]:
    vocab = engine.model_config.text.vocab_size - 200
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (b, ctx), generator=g).tolist()


def _set_mode(engine, graphs, mode: str) -> None:
    engine.runner.graphs = None if mode == "eager" else graphs
    engine.overlap = mode == "overlap"


def sampling_fields(spec: str) -> dict:
    """A --sampling item: "greedy", or ":"-joined SamplingParams fields, "temperature=0.7:top_p=0.9"."""
    if spec == "greedy":
        return dict(temperature=0)
    out = {}
    for item in spec.split(":"):
        key, val = item.split("=")
        if key not in ("temperature", "top_k", "top_p", "min_p"):
            raise SystemExit(f"--sampling: {key} is not one of temperature, top_k, top_p, min_p")
        out[key] = int(val) if key == "top_k" else float(val)
    return out


def _run(engine, prompts, tokens: int, sampling: str = "greedy") -> tuple[list[list[int]], float, int, float]:
    """-> (outputs, decode wall s, decode steps, host busy s during decode)."""
    from glmrt.sampling_params import SamplingParams

    fields = sampling_fields(sampling)
    seeded = fields.get("temperature", 1.0) > 0  # the same draws in every mode
    rids = [engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i if seeded else None,
                                                 **fields))[0] for i, p in enumerate(prompts)]
    while any(engine.requests[r].num_computed < len(engine.requests[r].prompt_ids) for r in rids):
        engine.step()  # prefill (chunked) until every request decodes
    torch.cuda.synchronize()
    steps, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    outs = [engine.requests.pop(r).output_ids for r in rids]
    return outs, wall, steps, cpu


def _check_graph_logits(engine, prompts) -> dict:
    """Graph replay vs the eager forward of the same decode batch on the same cache state."""
    from glmrt.engine.scheduler import Work
    from glmrt.sampling_params import SamplingParams

    runner, graphs = engine.runner, engine.runner.graphs
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0] for p in prompts]
    _set_mode(engine, graphs, "graphs")
    while any(engine.requests[r].num_computed < len(engine.requests[r].prompt_ids) for r in rids):
        engine.step()
    engine.step()  # one decode step through the graph (captures it)
    reqs = [engine.requests[r] for r in rids]
    work = [Work(r, r.num_computed, 1, True) for r in reqs]
    st = engine.cache.state
    snap = [t.clone() for t in (st.conv, st.recurrent, st.tail_k, st.tail_g)]
    from glmrt.engine.ranks import ForwardInputs
    eager = runner.run(ForwardInputs(ids=[r.token_slice(w.start, w.start + 1)[0] for r, w in zip(reqs, work)],
                                     prefix_lens=[w.start for w in work], seq_lens=[1] * len(work),
                                     slot_ids=[r.slot for r in reqs], page_tables=[r.pages for r in reqs],
                                     logits_rows=list(range(len(work))))).float().clone()
    for t, s in zip((st.conv, st.recurrent, st.tail_k, st.tail_g), snap):
        t.copy_(s)
    key = runner.graph_key(work)
    got = graphs.run(key, [r.token_slice(w.start, w.start + 1)[0] for r, w in zip(reqs, work)],
                     [w.start for w in work], [r.slot for r in reqs], [r.pages for r in reqs]).float().clone()
    for t, s in zip((st.conv, st.recurrent, st.tail_k, st.tail_g), snap):
        t.copy_(s)
    rel = float((got - eager).norm() / eager.norm())
    same_top = float((got.argmax(-1) == eager.argmax(-1)).float().mean())
    # the overlapped launch must not synchronise with the host
    plan = engine.scheduler.schedule()
    for w in plan.work:
        w.req.inflight += 1
    async_key = engine.runner.async_key(plan)
    ok_async = async_key is not None
    sync_error = None
    if ok_async:
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine.runner.launch(plan, None, async_key)
        except RuntimeError as e:  # a synchronising call inside the launch path
            sync_error = str(e).splitlines()[0]
            launched = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if launched is not None:
            engine._mark_launched(launched)
            engine._inflight = launched
            engine._resolve_inflight()  # the graphs-mode steps below are synchronous
    while engine.has_work():
        engine.step()
    for r in rids:
        engine.requests.pop(r, None)
    return {"graph_vs_eager_rel": rel, "graph_vs_eager_same_argmax": same_top, "key": list(key),
            "async_launch": ok_async, "sync_in_launch": sync_error}


def floor_ms(engine, b: int, ctx: int, tbps: float = CEILING_TBPS, experts_touched: int | None = None) -> float:
    """HBM floor of one decode step: the bytes it must touch over the measured copy ceiling.

    Every non-expert weight once (embedding: only b rows), the routed experts the batch is
    expected to reach (E (1 - (1 - k/E)^b) per MoE layer, uniform routing), the selected KV
    (<= 2048 + 15 latent rows per request and DSA layer, plus the pooled keys the indexer
    scores), and the KDA state read and written. `experts_touched` (distinct experts summed over
    the MoE layers, as measured in a step) replaces the uniform-routing expectation.
    """
    model, t = engine.model, engine.model_config.text
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    exp_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    dense = total - exp_bytes - embed.numel() * embed.element_size() + b * embed.shape[1] * embed.element_size()
    e, k = t.n_routed_experts, t.num_experts_per_tok
    per_expert = exp_bytes / max(1, len(experts) * e)
    routed = (len(experts) * e * (1 - (1 - k / e) ** b) if experts_touched is None else experts_touched) * per_expert
    lay = engine.layout
    kv = lay.num_dsa * b * min(ctx, t.index_topk_pools * t.index_kpool + t.index_kpool - 1) * lay.latent_row_bytes
    kv += lay.num_indexer * b * (ctx // t.index_kpool) * t.index_head_dim * 2
    state = 2 * b * lay.state_bytes_per_slot
    return (dense + routed + kv + state) / (tbps * 1e12) * 1e3


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--mem-fraction", type=float, default=0.5)
    p.add_argument("--quantization", default=None, help="fp8: block-scaled e4m3 linear layers and experts")
    p.add_argument("--modes", default="eager,graphs,overlap")
    p.add_argument("--sampling", default="greedy", help="comma list: greedy, or SamplingParams fields joined "
                   "by ':', e.g. temperature=0.7:top_k=50:top_p=0.9")
    p.add_argument("--split-gather", default="on", help="on,off: the on-GPU sampler's split gather and narrow "
                   "sort of small brackets (off: its select kernel reads each row in one program and sorts the "
                   "whole buffer)")
    args = p.parse_args(argv)
    as_engine_threads()  # host work timed as an engine actor does it
    from backends.kernels import sampling as ks
    split_gather, small_sort = ks.SPLIT_GATHER, ks.SMALL_SORT  # the defaults; set back at the end
    args.batch_list = [int(x) for x in args.batches.split(",")]

    engine = _engine(args)
    graphs = engine.runner.graphs
    if graphs is None:
        raise SystemExit("the engine did not enable CUDA graphs (backend not graph-safe?)")
    check = _check_graph_logits(engine, _prompts(engine, 4, args.context, seed=99))
    print("check:", check, flush=True)
    rows = []
    for b, sampling, split in itertools.product(args.batch_list, args.sampling.split(","),
                                                args.split_gather.split(",")):
        if sampling == "greedy" and split != args.split_gather.split(",")[0]:
            continue  # greedy rows take one argmax: no gather to compare
        ks.SPLIT_GATHER, ks.SMALL_SORT = (True, small_sort) if split == "on" else (False, 1 << 30)
        prompts = _prompts(engine, b, args.context, seed=b)
        row = {"batch": b, "context": args.context, "tokens": args.tokens, "sampling": sampling,
               "split_gather": split}
        outs = {}
        for mode in args.modes.split(","):
            _set_mode(engine, graphs, mode)
            if mode != "eager":  # capture outside the timed region
                for t in (args.context, args.context + args.tokens):
                    k = graphs.key(b, t // graphs.page_size + 1)
                    if k is not None:
                        graphs.capture(*k)
            o, wall, steps, cpu = _run(engine, prompts, args.tokens, sampling)
            outs[mode] = o
            row[f"{mode}_ms"] = 1000 * wall / max(steps, 1)
            row[f"{mode}_host_ms"] = 1000 * cpu / max(steps, 1)
            print(mode, b, f"{row[f'{mode}_ms']:.2f} ms/step", flush=True)
        key = graphs.key(b, -(-(args.context + args.tokens) // graphs.page_size))
        row["replay_ms"] = replay_ms(graphs.graphs[key][0]) if key in graphs.graphs else float("nan")
        row["floor_ms"] = floor_ms(engine, b, args.context + args.tokens // 2)
        ref = outs.get("eager") or outs[next(iter(outs))]
        for mode in ("graphs", "overlap"):
            if mode not in outs:
                row[f"{mode}_same_tokens"] = float("nan")
                row.setdefault(f"{mode}_ms", float("nan"))
                row.setdefault(f"{mode}_host_ms", float("nan"))
                continue
            same = sum(a == c for x, y in zip(ref, outs[mode]) for a, c in zip(x, y))
            row[f"{mode}_same_tokens"] = same / max(1, sum(len(x) for x in ref))
        rows.append(row)
    ks.SPLIT_GATHER, ks.SMALL_SORT = split_gather, small_sort
    write_out("decode_overlap.json", {"check": check, "rows": rows})
    for r in rows:
        r.setdefault("eager_ms", float("nan"))
    print(f"\ndecode step, {args.preset} {args.quantization or 'bf16'} cuda-h200 on {torch.cuda.get_device_name()}, context {args.context}, "
          f"{args.tokens} tokens; graph vs eager logits rel {check['graph_vs_eager_rel']:.2e}, "
          f"sync in overlapped launch: {check['sync_in_launch']}")
    print(f"{'batch':>5} {'sampling':>32} {'split':>5} {'eager':>8} {'graphs':>8} {'overlap':>8} {'replay':>8} "
          f"{'floor':>7} {'ovl/floor':>9} {'graphs/ovl':>10} {'same tok g/o':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['sampling'][:32]:>32} {r['split_gather']:>5} "
              f"{r['eager_ms']:>8.2f} {r['graphs_ms']:>8.2f} {r['overlap_ms']:>8.2f} "
              f"{r['replay_ms']:>8.2f} {r['floor_ms']:>7.2f} {r['overlap_ms'] / r['floor_ms']:>9.2f} "
              f"{r['graphs_ms'] / r['overlap_ms']:>10.2f} {r['graphs_same_tokens']:>6.2f}/{r['overlap_same_tokens']:.2f}")
    return rows


if __name__ == "__main__":
    main()
