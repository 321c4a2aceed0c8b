"""Train the `tiny-trained` model on the synthetic corpus with glmrt's own model modules.

One step: a batch of chats -> the text model (TrainingOps) -> LM head, next-token loss on the
model's output tokens; the MTP layer on the same hidden states, next-next-token loss; the KL
objective of every indexer towards its layer's dense attention (the indexer's input detached,
as DSA trains it, so that loss trains the indexer only). For the first `dense_steps` steps the
DSA layers attend densely (the indexer's warm-up); after that they attend to the pools the
indexer selects, as served. MoE routers are balanced by the correction-bias update (no
auxiliary loss): after each step a router's bias rises for its under-loaded experts and falls
for its over-loaded ones.

On the CPU the run is bitwise reproducible for a seed (same thread count); on CUDA it runs in
bf16 autocast. KDA runs the reference chunked form by default: fla-core's chunk_kda (`kda="fla"`)
autotunes its backward kernels for ~5 minutes on a fresh machine (measured on an H200), more
than the training run it would speed up.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from glmrt.checkpoint.presets import preset_config
from glmrt.config import ModelConfig
from glmrt.model.glm5_next import Glm5NextForCausalLM
from glmrt.model.loader import init_random
from glmrt.model.mla_dsa import Indexer
from glmrt.model.moe import Router
from glmrt.train.data import IGNORE, Batch, BatchStream, make_batch
from glmrt.train.ops import DenseBatch, TrainingCache, TrainingOps, indexer_kl


SYNC_EVERY = 10  # steps between reads of the losses (each read waits for the device)


@dataclass
class TrainConfig:
    steps: int = 3000
    batch_size: int = 128
    max_len: int = 704
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    dense_steps: int = 200         # DSA layers attend densely while the indexer warms up
    mtp_weight: float = 0.3
    mtp_depth: int = 1             # draft steps the MTP layer is unrolled for (chain drafting's steps)
    init_from: str | None = None   # start from this checkpoint's weights (None: random ones of `seed`)
    train_only: str = "all"        # "all", or "mtp": the MTP draft layer alone, the model frozen
    indexer_weight: float = 0.1
    bias_rate: float = 1e-3        # router correction-bias step per update
    seed: int = 0
    preset: str = "tiny-trained"
    device: str = "cpu"
    eval_every: int = 0            # 0: only at the end
    eval_problems: int = 200
    kda: str = "reference"         # "reference" (chunked delta rule in torch) or "fla" (fla-core's chunk_kda)
    workers: int = 0               # processes building batches ahead (0: in the training loop)


@dataclass
class StepStats:
    step: int
    loss: float
    lm: float
    mtp: float
    indexer: float
    seconds: float  # since the start, when the step's losses were read


@dataclass
class TrainResult:
    config: TrainConfig
    history: list[StepStats] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out exact accuracy)
    expert_load: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"config": asdict(self.config), "final_loss": self.history[-1].loss if self.history else None,
                "evals": self.evals, "seconds": self.seconds, "expert_load": self.expert_load}


def build_model(config: ModelConfig, ops: TrainingOps, device: torch.device, seed: int, *,
                init_from: str | None = None, train_only: str = "all") -> Glm5NextForCausalLM:
    """The serving model's modules, fp32, with gradients on every weight but the router bias
    (`train_only="mtp"`: on the MTP layer's alone). Random weights of `seed`, or a checkpoint's
    (`init_from`: a directory `glmrt train` wrote)."""
    if init_from is not None:
        from glmrt.model.loader import load_checkpoint
        model, _ = load_checkpoint(init_from, ops, dtype=torch.float32, device=device, with_vision=False)
    else:
        with torch.device(device):
            model = Glm5NextForCausalLM(config, ops, torch.float32, with_vision=False, with_mtp=True)
        init_random(model, seed)
        with torch.no_grad():  # the random-checkpoint head is deliberately peaky; training starts flat
            model.lm_head.weight.mul_(0.25)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias") and (train_only == "all" or name.startswith("mtp.")))
    for mod in model.modules():
        if isinstance(mod, Indexer):  # the KL loss trains the indexer alone (DSA's detached input)
            mod.register_forward_pre_hook(lambda m, args: tuple(a.detach() if torch.is_tensor(a) else a
                                                                 for a in args))
    return model


def forward_losses(model: Glm5NextForCausalLM, ops: TrainingOps, batch: Batch,
                   mtp_depth: int = 1) -> dict[str, torch.Tensor]:
    b, t = batch.input_ids.shape
    ids = batch.input_ids.reshape(-1)
    valid = _valid_mask(batch)
    meta = DenseBatch(b, t, valid)
    cache = TrainingCache()
    ops.reset()
    ops.set_valid(valid)
    text = model.model
    hidden = text(text.embed(ids), meta, cache)
    lm = F.cross_entropy(model.compute_logits(hidden).float(), batch.labels.reshape(-1), ignore_index=IGNORE)
    # Step j of the draft chain at position t: the embedding of token t+1+j and the hidden state
    # of step j-1 (step 0: the model's) -> token t+2+j. Teacher-forced, unrolled mtp_depth times,
    # gradients through the chain; the loss is the mean over the steps. An approximation of how
    # the chain is served: there step j attends to step-0 entries of the earlier positions and
    # the chain's own, here to step j's entries of every earlier position.
    draft, mtp = hidden, []
    for j in range(mtp_depth):
        nxt = _shift(batch.input_ids, j + 1, batch.input_ids[:, -1:])
        draft = model.mtp.draft(text.embed(nxt.reshape(-1)), draft, meta, cache)
        labels = batch.mtp_labels if j == 0 else _shift(batch.mtp_labels, j, IGNORE)
        mtp.append(F.cross_entropy(model.compute_logits(draft).float(), labels.reshape(-1), ignore_index=IGNORE))
    mtp = torch.stack(mtp).mean()
    kl = indexer_kl(ops.records.indexer)
    return {"lm": lm, "mtp": mtp, "indexer": kl if kl is not None else lm.new_zeros(())}


def _shift(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """[B, T] -> [B, T]: column t holds x[:, t + by]; the last `by` columns are `fill`."""
    pad = fill.expand(-1, by) if torch.is_tensor(fill) else torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


def _valid_mask(batch: Batch) -> torch.Tensor:
    """Real tokens: every position up to a row's last output label (right padding after it)."""
    b, t = batch.input_ids.shape
    has = (batch.labels != IGNORE) | (batch.mtp_labels != IGNORE)
    pos = torch.arange(t, device=batch.input_ids.device).expand(b, t)
    last = torch.where(has, pos, -1).amax(dim=1, keepdim=True) + 2
    return (pos < last).reshape(-1)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _update_router_bias(model, records, rate: float) -> None:
    """Balance the routers being trained (a frozen router's weight takes no gradient: its bias stays)."""
    routers = {id(m.weight): m for m in model.modules() if isinstance(m, Router)}
    with torch.no_grad():
        for gate_w, load in records.routes:
            if gate_w.requires_grad:
                routers[id(gate_w)].e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))


def expert_load(model, records) -> dict[str, list[float]]:
    """Per router, each expert's share of the picks over the mean share (1.0 = balanced)."""
    names = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, Router)}
    out = {}
    for gate_w, load in records.routes:
        out[names[id(gate_w)]] = [round(x, 3) for x in (load / load.mean().clamp_min(1e-9)).tolist()]
    return out


@torch.no_grad()
def held_out_accuracy(model, ops: TrainingOps, tok, count: int, seed: int, device, batch_size: int = 50) -> float:
    """Greedy exact-match accuracy on held-out problems, computed teacher-forced in one forward:
    greedy decoding writes the reference reply exactly iff every reply token is the argmax given
    the reference before it (the final answer is in the reply)."""
    from glmrt.train.corpus import held_out_problems, math_chat

    problems = held_out_problems(seed, count)
    right = 0
    dsa_dense = ops.dense_attention
    for i in range(0, count, batch_size):
        chats = [math_chat(p, q) for p, q in problems[i:i + batch_size]]
        batch = make_batch(tok, chats, 10_000).to(device)
        b, t = batch.input_ids.shape
        valid = _valid_mask(batch)
        ops.reset()
        ops.set_valid(valid)
        with _autocast(device):
            hidden = model.model(model.model.embed(batch.input_ids.reshape(-1)), DenseBatch(b, t, valid),
                                 TrainingCache())
            pred = model.compute_logits(hidden).argmax(-1).view(b, t)
        wrong = (batch.labels != IGNORE) & (pred != batch.labels)
        right += int((~wrong.any(dim=1)).sum())
    ops.dense_attention = dsa_dense
    ops.reset()
    return right / count


def _autocast(device):
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(cfg: TrainConfig, tok, *, progress: bool = True) -> tuple[Glm5NextForCausalLM, TrainResult]:
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    config = preset_config(cfg.preset)
    if tok.get_vocab_size() != config.text.vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} ids, the {cfg.preset} model {config.text.vocab_size}")
    if cfg.kda not in ("fla", "reference"):
        raise ValueError(f"kda must be fla or reference, got {cfg.kda!r}")
    ops = TrainingOps(use_fla=cfg.kda == "fla")
    if cfg.train_only not in ("all", "mtp"):
        raise ValueError(f"train_only must be all or mtp, got {cfg.train_only!r}")
    model = build_model(config, ops, device, cfg.seed, init_from=cfg.init_from, train_only=cfg.train_only)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            foreach=device.type == "cuda")
    result = TrainResult(cfg)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc="training", unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    stream = BatchStream(tok, cfg.seed, cfg.batch_size, cfg.max_len, workers=cfg.workers)
    try:
        _run_steps(cfg, model, ops, opt, stream, tok, device, result, bar, start)
    finally:
        stream.close()
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - start
    return model, result


def _run_steps(cfg: TrainConfig, model, ops: TrainingOps, opt, stream: BatchStream, tok, device,
               result: TrainResult, bar, start: float) -> None:
    records = None
    pending: list[tuple[int, torch.Tensor]] = []
    for step in range(cfg.steps):
        batch = stream.batch(step).to(device)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        ops.dense_attention = step < cfg.dense_steps
        with _autocast(device):
            parts = forward_losses(model, ops, batch, cfg.mtp_depth)
            loss = parts["lm"] + cfg.mtp_weight * parts["mtp"] + cfg.indexer_weight * parts["indexer"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        records = ops.reset()
        _update_router_bias(model, records, cfg.bias_rate)
        pending.append((step, torch.stack([loss.detach(), parts["lm"].detach(), parts["mtp"].detach(),
                                           parts["indexer"].detach()])))
        last = step == cfg.steps - 1
        if len(pending) == SYNC_EVERY or last:  # read the losses back in blocks: one host wait per block
            now = time.perf_counter() - start
            for s, values in zip((p[0] for p in pending), torch.stack([p[1] for p in pending]).tolist()):
                result.history.append(StepStats(s, *values, now))
            if bar is not None:
                h = result.history[-1]
                bar.set_postfix(loss=f"{h.loss:.3f}", lm=f"{h.lm:.3f}", mtp=f"{h.mtp:.3f}", idx=f"{h.indexer:.3f}",
                                refresh=False)
                bar.update(len(pending))
            pending = []
        if cfg.eval_problems and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last):
            result.evals.append((step + 1, held_out_accuracy(model, ops, tok, cfg.eval_problems, cfg.seed, device)))
            if bar is not None:
                bar.write(f"step {step + 1}: held-out exact accuracy {result.evals[-1][1]:.3f}")
    if records is not None:
        result.expert_load = expert_load(model, records)
