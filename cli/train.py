"""`glmrt train`: train the tiny-trained model on the synthetic corpus and write its checkpoint."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train the small GLM-5.3-Flash model on the synthetic corpus",
        description="Train the tiny-trained model (every layer kind of GLM-5.3-Flash at ~1.3M parameters) on "
                    "chats generated from --seed: arithmetic with the working in <think>, the same with "
                    "thinking off, tool calls and JSON answers. Writes a checkpoint that `glmrt up --model DIR` "
                    "serves, loss.png, train_summary.json and the held-out problems (held_out.jsonl, GSM8K "
                    "format, for `glmrt eval --data`). Same seed on the CPU: bitwise the same weights.")
    p.add_argument("--out", required=True, help="output directory (the checkpoint)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto picks cuda when there is one")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-len", type=int, default=704, help="longest chat in tokens")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--dense-steps", type=int, default=None,
                   help="steps of dense DSA attention while the indexer warms up (default: steps / 15; 0 with --init-from)")
    p.add_argument("--mtp-depth", type=int, default=1,
                   help="draft steps the MTP layer is trained for, chained as speculative decoding runs it "
                        "(each step: the previous step's hidden state and the next token)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start from this checkpoint's weights and tokenizer (one `glmrt train` wrote) instead of "
                        "random ones")
    p.add_argument("--train-only", choices=["all", "mtp"], default="all",
                   help="mtp: train the MTP draft layer alone, the model frozen (its answers stay the same)")
    p.add_argument("--seed", type=int, default=0, help="corpus, tokenizer and initialisation seed")
    p.add_argument("--eval-problems", type=int, default=500,
                   help="held-out problems scored (greedy exact match) at the end, and in held_out.jsonl")
    p.add_argument("--eval-every", type=int, default=0, help="also score them every N steps (0: only at the end)")
    p.add_argument("--kda", choices=["reference", "fla"], default="reference",
                   help="KDA kernel: the reference chunked form (torch), or fla-core's chunk_kda (its kernels "
                        "autotune for minutes on a fresh machine)")
    p.add_argument("--data-workers", type=int, default=None,
                   help="processes building batches ahead of the training loop (default: 0 on the CPU, "
                        "min(8, CPUs - 1) on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _refuse(msg: str) -> int:
    print(f"glmrt train: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "batch_size", "max_len"):
        if getattr(args, name) < 1:
            return _refuse(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        return _refuse(f"--lr must be positive, got {args.lr}")
    if args.eval_problems < 0 or args.eval_every < 0:
        return _refuse("--eval-problems and --eval-every must not be negative")
    if args.dense_steps is not None and args.dense_steps < 0:
        return _refuse("--dense-steps must not be negative")
    init = os.path.abspath(os.path.expanduser(args.init_from)) if args.init_from else None
    if init is not None and not os.path.exists(os.path.join(init, "tokenizer.json")):
        return _refuse(f"--init-from {args.init_from}: no checkpoint with a tokenizer.json there")
    if args.train_only == "mtp" and init is None:
        return _refuse("--train-only mtp trains the draft layer of a trained model: give --init-from DIR")
    if not 1 <= args.mtp_depth <= 8:
        return _refuse(f"--mtp-depth must be in [1, 8], got {args.mtp_depth}")
    if args.data_workers is not None and args.data_workers < 0:
        return _refuse(f"--data-workers must not be negative, got {args.data_workers}")
    if args.threads is not None and args.threads < 1:
        return _refuse(f"--threads must be at least 1, got {args.threads}")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        return _refuse(f"--device {args.device!r} is not a device (cpu, cuda, cuda:N)")
    if dev.type not in ("cpu", "cuda"):
        return _refuse(f"--device must be cpu or cuda, got {args.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return _refuse("--device cuda: no CUDA device is available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.kda == "fla":
        import importlib.util
        if importlib.util.find_spec("fla") is None:
            return _refuse("--kda fla: fla-core is not installed")

    from glmrt.train.data import train_tokenizer
    from glmrt.train.output import plot_losses, save_checkpoint, write_held_out, write_summary
    from glmrt.train.trainer import TrainConfig, train

    workers = args.data_workers
    if workers is None:
        workers = 0 if dev.type == "cpu" else max(0, min(8, (os.cpu_count() or 1) - 1))
    # the dense warm-up is the indexer's first training: a trained model's indexers need none
    dense = args.dense_steps if args.dense_steps is not None else (0 if init else args.steps // 15)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr,
                      warmup_steps=min(100, max(1, args.steps // 20)), dense_steps=dense, seed=args.seed,
                      device=str(dev), eval_every=args.eval_every, eval_problems=args.eval_problems, kda=args.kda,
                      workers=workers, mtp_depth=args.mtp_depth,
                      init_from=init, train_only=args.train_only)
    out = os.path.abspath(os.path.expanduser(args.out))
    os.makedirs(out, exist_ok=True)
    from glmrt.checkpoint.presets import preset_config
    if init is not None:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(init, "tokenizer.json"))
    else:
        tok = train_tokenizer(preset_config(cfg.preset).text.vocab_size, args.seed)
    model, result = train(cfg, tok, progress=not args.no_progress)
    save_checkpoint(model, tok, out)
    plot_losses(result, os.path.join(out, "loss.png"))
    write_summary(result, os.path.join(out, "train_summary.json"))
    if args.eval_problems:
        write_held_out(out, args.seed, args.eval_problems)
    last = result.history[-1]
    acc = f", held-out exact accuracy {result.evals[-1][1]:.1%}" if result.evals else ""
    print(f"trained {cfg.preset} for {cfg.steps} steps in {result.seconds:.0f} s on {dev}: loss {last.loss:.4f} "
          f"(lm {last.lm:.4f}, mtp {last.mtp:.4f}, indexer {last.indexer:.4f}){acc}; wrote {out}")
    return 0
