"""Device launches of a speculative cycle's parts, counted on the CPU.

    python3 -m bench.launch_count [--tokens 12] [--top 0]

Runs the shipped trained model with the `cuda-h200` kernels in Triton's interpreter (what the
speculative CUDA graphs capture on the GPU, eagerly): a plain decode step, the draft chain, the
verify and the rollback bodies of glmrt.engine.spec_graphs, greedy on one held-out chat. Counts,
per part and call, every Triton launch and every torch op that launches a kernel on the GPU
(views, shape queries and allocations excluded), attributed to the glmrt function that issued
it. On a model this small a step is bound by its launches (~1.7 µs each on the H200), so the
count is what the cycle's GPU time follows; the numbers on the GPU come from bench.spec_cycle.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that launch nothing on the GPU: views, metadata, allocations, host reads
_NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
              "squeeze", "select", "slice", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk",
              "narrow", "diagonal", "unflatten", "flatten", "_reshape_alias", "lift_fresh", "empty", "empty_strided",
              "empty_like", "new_empty", "_local_scalar_dense", "item", "is_nonzero", "sym_size", "sym_stride",
              "dim", "size", "stride", "numel", "view_as", "expand_as", "movedim", "set_"}
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("plain_decode", "draft_chain", "verify", "rollback")


class Counter:
    def __init__(self):
        self.part: str | None = None
        self.inside_kernel = 0
        self.calls = collections.Counter()
        self.launches = collections.Counter()   # (part, what, where) -> launches

    def count(self, what: str) -> None:
        if self.part is not None and not self.inside_kernel:
            self.launches[(self.part, what, _site())] += 1

    def wrap(self, obj, name: str, part: str) -> None:
        f = getattr(obj, name)

        def counted(*a, **k):
            prev, self.part = self.part, part
            self.calls[part] += 1
            try:
                return f(*a, **k)
            finally:
                self.part = prev
        setattr(obj, name, counted)


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-3]):
        f = os.path.abspath(fr.filename)
        if f.startswith(_ROOT) and "site-packages" not in f and not f.endswith("launch_count.py"):
            return f"{os.path.relpath(f, _ROOT)} {fr.name}"
    return "?"


def _install(counter: Counter):
    import triton.runtime.interpreter as interp

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_LAUNCH:
                counter.count("aten." + func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    run = interp.GridExecutor.__call__

    def launch(self, *a, **k):  # one launch; the interpreter's own tensor work inside is not one
        counter.count("triton." + self.fn.__name__)
        counter.inside_kernel += 1
        try:
            return run(self, *a, **k)
        finally:
            counter.inside_kernel -= 1
    interp.GridExecutor.__call__ = launch
    return Ops()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=12, help="output tokens of the chat (default 12)")
    p.add_argument("--steps", type=int, default=3, help="draft tokens K (default 3)")
    p.add_argument("--top", type=int, default=0, help="also list the N functions with the most launches per part")
    p.add_argument("--ops", action="store_true", help="with --top: list (op, function) pairs instead of functions")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, _ROOT)
    from tokenizers import Tokenizer

    from backends.cuda_h200 import CudaH200Ops
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.engine.spec_graphs import SpecGraphs
    from glmrt.model.loader import load_checkpoint
    from glmrt.sampling_params import SamplingParams
    from glmrt.serving.chat_template import render_chat
    from glmrt.train.corpus import held_out_chats

    trained = os.path.join(_ROOT, "glmrt", "checkpoint", "tiny_trained")
    tok = Tokenizer.from_file(os.path.join(trained, "tokenizer.json"))
    chat = held_out_chats(0, 1)[0]
    prompt = tok.encode(render_chat(chat.messages[:-1], chat.tools, thinking=True), add_special_tokens=False).ids
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    model, _ = load_checkpoint(trained, CudaH200Ops(), dtype=torch.float32, with_mtp=True)
    counter = Counter()
    mode = _install(counter)

    plain = Engine(EngineConfig(model=trained, page_size=16, skip_server_warmup=True), model=model,
                   log=lambda *a: None)
    forward = model.forward

    def decode_forward(ids, meta, *a, **k):
        if all(s == 1 for s in meta.seq_lens):
            prev, counter.part = counter.part, "plain_decode"
            counter.calls["plain_decode"] += 1
            try:
                return forward(ids, meta, *a, **k)
            finally:
                counter.part = prev
        return forward(ids, meta, *a, **k)
    model.forward = decode_forward
    with mode:
        plain.generate([prompt], params)
    model.forward = forward
    del plain

    spec = Engine(EngineConfig(model=trained, page_size=16, skip_server_warmup=True, speculative_algorithm="EAGLE",
                               speculative_num_steps=args.steps), model=model, log=lambda *a: None)
    pad_slot, pad_page = spec.slots.allocate(), spec.pages.allocate(1)[0]
    graphs = SpecGraphs(spec.model, spec.cache, args.steps, max_bs=4, max_pages=-(-spec.context_length // 16),
                        pad_slot=pad_slot, pad_page=pad_page, capture=False)  # the graph bodies, run eagerly
    spec.spec.graphs = graphs
    for name in ("draft_chain", "verify", "rollback"):
        counter.wrap(graphs, name, name)
    with mode:
        spec.generate([prompt], params)

    per_call = {part: sum(n for (p_, _, _), n in counter.launches.items() if p_ == part) / counter.calls[part]
                for part in PARTS if counter.calls[part]}
    for part in PARTS:
        if part not in per_call or not args.top:
            continue
        by_site = collections.Counter()
        for (p_, what, site), n in counter.launches.items():
            if p_ == part:
                by_site[f"{what}  {site}" if args.ops else site] += n / counter.calls[part]
        print(f"--- {part}: the {args.top} functions with the most launches per call")
        for site, n in by_site.most_common(args.top):
            print(f"{n:7.1f}  {site}")
    print(f"\nK = {args.steps}, batch 1, the trained tiny model, `cuda-h200` kernels interpreted on the CPU")
    print("| part | calls | launches per call | / plain decode step |")
    print("|---|---|---|---|")
    base = per_call.get("plain_decode")
    for part, n in per_call.items():
        print(f"| {part} | {counter.calls[part]} | {n:.0f} | {n / base:.2f} |" if base else f"| {part} | {n:.0f} |")


if __name__ == "__main__":
    main()
