"""What a training run leaves in its output directory: the checkpoint, the loss curve, a summary.

The checkpoint is the HF-format directory every glmrt checkpoint is (config.json, bf16
model.safetensors, generation_config.json, the corpus tokenizer with the chat template), so
`glmrt up --model DIR` serves it; the held-out set goes beside it in GSM8K format for
`glmrt eval --data`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from glmrt.checkpoint.writer import TensorSpec, write_checkpoint
from glmrt.train.corpus import held_out_gsm8k
from glmrt.train.trainer import TrainResult

_EXPERT_ROW = re.compile(r"\.experts\.(\d+)\.")
HELD_OUT_FILE = "held_out.jsonl"


def save_checkpoint(model, tok, out_dir: str | Path) -> dict:
    """Write the trained model (bf16; fp32-kept parameters stay fp32) and its tokenizer."""
    params = dict(model.named_parameters())

    def value(spec: TensorSpec) -> torch.Tensor:
        p = params[spec.param].detach()
        row = _EXPERT_ROW.search(spec.name)
        if ".mlp.experts." in spec.param and row:  # a routed expert: one row of the stacked tensor
            p = p[int(row.group(1))]
        return p.float().cpu()

    return write_checkpoint(model.config, str(out_dir), dtype="bfloat16", values=value, tokenizer_object=tok,
                            progress=False)


def write_held_out(out_dir: str | Path, seed: int, count: int) -> Path:
    path = Path(out_dir) / HELD_OUT_FILE
    with open(path, "w", encoding="utf-8") as f:
        for rec in held_out_gsm8k(seed, count):
            f.write(json.dumps(rec) + "\n")
    return path


def plot_losses(result: TrainResult, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step + 1 for h in result.history]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("loss", "total"), ("lm", "next token"), ("mtp", "MTP (next-next token)"),
                       ("indexer", "indexer KL")):
        raw = [getattr(h, key) for h in result.history]
        line, = ax.plot(steps, raw, linewidth=0.6, alpha=0.35 if len(raw) > 100 else 1.0)
        if len(raw) > 100:  # the batch-to-batch noise hides the trend: draw a running mean over it
            smooth, acc = [], raw[0]
            for x in raw:
                acc = 0.95 * acc + 0.05 * x
                smooth.append(acc)
            ax.plot(steps, smooth, color=line.get_color(), linewidth=1.4, label=label)
        else:
            line.set_label(label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    title = f"{result.config.preset}: {len(steps)} steps, batch {result.config.batch_size}, seed {result.config.seed}"
    if result.evals:
        title += f"; held-out exact {result.evals[-1][1]:.1%}"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(result: TrainResult, path: str | Path) -> None:
    data = result.summary()
    data["history"] = [[h.step, round(h.loss, 6), round(h.lm, 6), round(h.mtp, 6), round(h.indexer, 6)]
                       for h in result.history]
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
