"""Attention-side decode cost per layer of `flash-4l` on the GPU, across batch and context.

    python3 -m bench.attention_layer [--batches 1,16,64,128] [--contexts 4096,32768,131072]

One DSA layer (q/kv LoRA projections, latent write, the DSA indexer: pooled-key update,
scores, top-128 pools; sparse absorbed MLA over the 128 x 16 selected tokens + tail; o_proj)
and one KDA layer (projections, causal conv, the fla recurrent step on the state slots in
place, gated norm, o_proj), exactly as the model runs them with the `cuda-h200` kernels, at
full flash width (hidden 4096, 64 heads). Every request holds `context` cached tokens on
pages scattered at random through a pool of random bf16 latents and pooled keys. Each
layer's forward is captured in a CUDA graph and the median replay time is reported (no
launch gaps: what a decode step pays per layer).

The sparse attention touches a fixed number of tokens per query (2048 + tail), so the DSA
layer at 128K should cost about what it costs at 4K; only the indexer's scoring (one
pooled key per 16 tokens) grows with the context. Prints a short table last; JSON to
$OUT/attention_layer.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.h200 import write_out
from bench.timing import graph_ms


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]

    from backends.cuda_h200 import CudaH200Ops
    from backends.meta import BatchMeta
    from glmrt.cache.pools import ModelCache
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy

    dev, dt, ps = "cuda", torch.bfloat16, args.page_size
    cfg = preset_config("flash-4l")
    # attention is what is measured: 8 experts keep the (unused) MoE small
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_routed_experts=8))
    text = cfg.text
    model = load_dummy(cfg, CudaH200Ops(), dtype=dt, device=dev, with_vision=False, with_mtp=False)
    dsa_layer = model.model.layers[text.dsa_layers[0]].self_attn
    kda_layer = model.model.layers[text.kda_layers[0]].self_attn
    max_b, max_ctx = max(batches), max(contexts)
    num_pages = max_b * (max_ctx // ps + 1) + 1
    cache = ModelCache.allocate(text, num_pages, max_b + 1, dev, page_size=ps)
    g = torch.Generator(device=dev).manual_seed(0)
    for t in (cache.kv.latent, cache.kv.pooled, cache.state.tail_k, cache.state.tail_g):
        flat = t.view(-1)
        for i in range(0, flat.numel(), 1 << 28):  # chunks: no fp32 copy of the whole pool
            chunk = flat[i:i + (1 << 28)]
            chunk.copy_(torch.randn(chunk.shape, generator=g, device=dev, dtype=torch.float32) * 0.5)
    cache.state.recurrent.normal_(0, 0.05, generator=g)
    cache.state.conv.normal_(0, 0.5, generator=g)
    print(f"pools: KV {cache.kv.nbytes / 2**30:.1f} GiB, state {cache.state.nbytes / 2**30:.2f} GiB", flush=True)

    rows = []
    perm_gen = torch.Generator().manual_seed(1)
    for b in batches:
        x = torch.randn(b, text.hidden_size, generator=g, device=dev, dtype=torch.float32).to(dt)
        for ctx in contexts:
            need = ctx // ps + 1
            pages = torch.randperm(num_pages - 1, generator=perm_gen)[: b * need].view(b, need).tolist()
            meta = BatchMeta.build([ctx - 1] * b, [1] * b, list(range(b)), pages, ps, dev)
            dsa_ms = graph_ms(lambda: dsa_layer(x, meta, cache, None))
            kda_ms = graph_ms(lambda: kda_layer(x, meta, cache)) if ctx == contexts[0] else rows[-1]["kda_ms"]
            rows.append({"batch": b, "context": ctx, "dsa_ms": dsa_ms, "kda_ms": kda_ms})
            print(f"B={b} ctx={ctx}: DSA layer {dsa_ms * 1000:.0f} us, KDA layer {kda_ms * 1000:.0f} us", flush=True)
    write_out("attention_layer.json", rows)
    print(f"\nattention-side decode cost per layer, flash-4l bf16, cuda-h200 kernels, graph replay, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'context':>8} {'DSA layer us':>13} {'KDA layer us':>13} {'DSA / DSA@' + str(contexts[0]):>14}")
    for r in rows:
        base = next(x for x in rows if x["batch"] == r["batch"] and x["context"] == contexts[0])
        print(f"{r['batch']:>5} {r['context']:>8} {r['dsa_ms'] * 1000:>13.0f} {r['kda_ms'] * 1000:>13.0f} "
              f"{r['dsa_ms'] / base['dsa_ms']:>14.2f}")
    return rows


if __name__ == "__main__":
    main()
