"""Time the training step of the tiny-trained model: where a step's time goes.

    python3 -m bench.train_step --device cuda --batch-size 256 --steps 30 --profile

Runs the trainer's own step (glmrt/train/trainer.py: forward_losses, backward, AdamW, router
bias) on the corpus's batches and prints, per step after warm-up, the wall time split into the
batch's host preparation and the device step, then (with --profile) the kernels that take the
most GPU time. Ends with a short table.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--kda", default="reference", choices=["reference", "fla"])
    ap.add_argument("--data-workers", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    from glmrt.checkpoint.presets import preset_config
    from glmrt.train.data import BatchStream, train_tokenizer
    from glmrt.train.ops import TrainingOps
    from glmrt.train.trainer import TrainConfig, _autocast, _update_router_bias, build_model, forward_losses

    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = TrainConfig(batch_size=args.batch_size, device=args.device)
    config = preset_config(cfg.preset)
    tok = train_tokenizer(config.text.vocab_size, cfg.seed)
    ops = TrainingOps(use_fla=args.kda == "fla")
    model = build_model(config, ops, dev, cfg.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                            foreach=dev.type == "cuda")
    stream = BatchStream(tok, cfg.seed, cfg.batch_size, cfg.max_len, workers=args.data_workers)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(i: int):
        t0 = time.perf_counter()
        batch = stream.batch(i)
        t1 = time.perf_counter()
        batch = batch.to(dev)
        ops.dense_attention = False
        with _autocast(dev):
            parts = forward_losses(model, ops, batch)
            loss = parts["lm"] + 0.3 * parts["mtp"] + 0.1 * parts["indexer"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _update_router_bias(model, ops.reset(), 1e-3)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t1, batch.input_ids.shape[1], batch.num_tokens

    t = time.perf_counter()
    for i in range(args.warmup):
        r = step(i)
        print(f"warm-up step {i}: width {r[3]}, {time.perf_counter() - t:.1f} s", flush=True)
    sync()
    print(f"warm-up: {args.warmup} steps in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    prof = None
    if args.profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    for i in range(args.warmup, args.warmup + args.steps):
        rows.append(step(i))
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    n = len(rows)
    data = sum(r[0] for r in rows) / n
    launch = sum(r[1] for r in rows) / n
    total = sum(r[2] for r in rows) / n
    toks = sum(r[4] for r in rows) / n
    widths = sorted({r[3] for r in rows})
    print(f"| batch | widths | data ms | host issue ms | step ms | real tok/s |")
    print(f"|---|---|---|---|---|---|")
    print(f"| {args.batch_size} | {len(widths)} ({widths[0]}..{widths[-1]}) | {data * 1e3:.1f} | {launch * 1e3:.1f} "
          f"| {total * 1e3:.1f} | {toks / total:,.0f} |")


if __name__ == "__main__":
    main()
