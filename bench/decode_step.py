"""The whole decode step of `flash-4l` on one GPU: ours with the reference kernels, ours with
the `cuda-h200` kernels launched eagerly, the same kernels replayed from a decode CUDA graph
(the serving path), and transformers 5.17.0 on the same weights (copied in memory), side by side.

    python3 -m bench.decode_step [--batches 1,16] [--context 512] [--steps 10]

Each request is prefilled with `--context` random tokens, then every engine decodes one token
per request per step; the median step time is reported. Prints a short table last; JSON to
$OUT/decode_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.h200 import write_out
from bench.timing import as_engine_threads


def _set_ops(model, ops) -> None:
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops
    model.ops = ops


def _time(fn, steps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-hf", action="store_true")
    args = p.parse_args(argv)
    as_engine_threads()  # host work timed as an engine actor does it

    from backends.cuda_h200 import CudaH200Ops
    from backends.reference import ReferenceOps
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    dtype, dev = torch.bfloat16, "cuda"
    cfg = preset_config(args.preset)
    ours = load_dummy(cfg, ReferenceOps(), dtype=dtype, device=dev, with_mtp=False)  # HF needs the vision weights too
    hf = None
    if not args.no_hf:
        from bench.hf_reference import build_hf_from_ours
        hf = build_hf_from_ours(ours, dev, dtype)
    vocab = cfg.text.vocab_size - 100
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(10, vocab, (b, args.context), generator=g)
        row = {"batch": b, "context": args.context}
        for name, ops in (("reference", ReferenceOps()), ("cuda-h200", CudaH200Ops())):
            _set_ops(ours, ops)
            sess = DirectSession(ours, max_requests=b, max_tokens=args.context + 4 * args.steps + 8, page_size=64,
                                 shuffle_pages=False)
            rids = [sess.new_request() for _ in range(b)]
            with torch.no_grad():
                sess.step({r: prompts[i] for i, r in enumerate(rids)}, all_logits=False)
            nxt = {r: [11] for r in rids}
            row[f"{name}_ms"] = _time(lambda: sess.step(nxt, all_logits=False), args.steps)
            del sess
            torch.cuda.empty_cache()
        # the serving path: cuda-h200 kernels replayed from a decode CUDA graph (glmrt.engine.cuda_graphs)
        from glmrt.engine.cuda_graphs import DecodeGraphs
        _set_ops(ours, CudaH200Ops())
        sess = DirectSession(ours, max_requests=b + 1, max_tokens=args.context + 4 * args.steps + 8, page_size=64,
                             shuffle_pages=False)
        rids = [sess.new_request() for _ in range(b)]
        with torch.no_grad():
            sess.step({r: prompts[i] for i, r in enumerate(rids)}, all_logits=False)
        graphs = DecodeGraphs(ours, sess.cache, max_bs=b, max_pages=sess.pages_per_req, pad_slot=b,
                              pad_page=sess._free_pages[0])

        def graph_step():
            lens = [sess.lens[r] for r in rids]
            key = graphs.key(b, max(n // 64 + 1 for n in lens))
            graphs.run(key, [11] * b, lens, [sess.slots[r] for r in rids], [sess.pages[r] for r in rids])
            for r in rids:
                sess.lens[r] += 1
        row["graphs_ms"] = _time(graph_step, args.steps)
        del sess, graphs
        torch.cuda.empty_cache()
        if hf is not None:
            with torch.no_grad():
                out = hf(input_ids=prompts.to(dev), use_cache=True)
                past = out.past_key_values
                tok = torch.full((b, 1), 11, dtype=torch.long, device=dev)

                def hf_step():
                    nonlocal past
                    past = hf(input_ids=tok, past_key_values=past, use_cache=True).past_key_values
                row["hf_ms"] = _time(hf_step, args.steps)
            del past, out
            torch.cuda.empty_cache()
        rows.append(row)
    write_out("decode_step.json", rows)
    print(f"decode step, {args.preset} bf16 on {torch.cuda.get_device_name()}, context {args.context}")
    print(f"{'batch':>5} {'ours ref ms':>12} {'ours h200 ms':>13} {'h200 graph ms':>14} {'HF ms':>9} "
          f"{'ref/graph':>10} {'HF/graph':>9}")
    for r in rows:
        hf_ms = r.get("hf_ms", float("nan"))
        print(f"{r['batch']:>5} {r['reference_ms']:>12.1f} {r['cuda-h200_ms']:>13.1f} {r['graphs_ms']:>14.2f} "
              f"{hf_ms:>9.1f} {r['reference_ms'] / r['graphs_ms']:>10.1f} {hf_ms / r['graphs_ms']:>9.1f}")
    return rows


if __name__ == "__main__":
    main()
