"""The rank processes of tests/model/test_tensor_parallel.py, and the runs both sides compare.

`python -m tests.model.tp_ranks RANK WORLD INIT_FILE JOBS_JSON` joins a gloo group of WORLD
processes (one torch thread each) and runs every job of JOBS_JSON in order, each rank writing
`<out>.rank<RANK>.safetensors`. A job loads its model (a checkpoint or random weights, at a
tensor / expert parallel size) and runs `greedy_run` and `mtp_run`; the test runs the same
functions at TP 1 in its own process.
"""

from __future__ import annotations

import json
import sys

import torch

from backends.meta import BatchMeta
from backends.reference import ReferenceOps
from glmrt.model.session import DirectSession

# a mixed first step (three prompts of different lengths, longer than tiny's index_topk),
# then greedy decode steps of all three at once
PROMPT_LENS = (41, 23, 57)
DECODE_STEPS = 5


def prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 60, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy_run(model, vocab: int) -> dict[str, torch.Tensor]:
    """Every logit of the prefill step and of each decode step, and the greedy tokens (with a
    step of no tokens between prefill and decode)."""
    session = DirectSession(model, max_requests=len(PROMPT_LENS), max_tokens=128)
    rids = [session.new_request() for _ in PROMPT_LENS]
    out = session.step(dict(zip(rids, prompts(vocab))))
    result = {f"prefill.{i}": out[r] for i, r in enumerate(rids)}
    result["empty"] = empty_step(model, session)  # a step of no tokens still takes every collective
    tokens = [[int(out[r][-1].argmax())] for r in rids]
    for step in range(DECODE_STEPS):
        out = session.step({r: [tokens[i][-1]] for i, r in enumerate(rids)})
        for i, r in enumerate(rids):
            result[f"decode.{step}.{i}"] = out[r][0]
            tokens[i].append(int(out[r][0].argmax()))
    result["tokens"] = torch.tensor(tokens)
    return result


@torch.no_grad()
def empty_step(model, session: DirectSession) -> torch.Tensor:
    """A forward (target and, if present, draft) of 0 tokens -> its [0, V] logits."""
    meta = BatchMeta.build([], [], [], [], session.page_size, model.device)
    none = torch.empty(0, dtype=torch.long, device=model.device)
    logits, hidden = model(none, meta, session.cache)
    if model.mtp is not None:
        draft = model.mtp(model.model.embed(none), hidden, meta, session.cache)
        logits = torch.cat([logits, model.compute_logits(draft)])
    return logits


@torch.no_grad()
def mtp_run(model, vocab: int) -> dict[str, torch.Tensor]:
    """The MTP draft layer's logits over one prompt (fed the target's hidden states)."""
    ids = torch.tensor(prompts(vocab)[0])
    session = DirectSession(model, max_requests=1, max_tokens=128)
    rid = session.new_request()
    meta = BatchMeta.build([0], [len(ids)], [session.slots[rid]], [session.pages[rid]], session.page_size,
                           model.device)
    _, hidden = model(ids, meta, session.cache)
    next_ids = torch.cat([ids[1:], ids[:1]])
    draft = model.mtp(model.model.embed(next_ids), hidden, meta, session.cache)
    return {"mtp": model.compute_logits(draft)}


def load(job: dict, parallel):
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_checkpoint, load_dummy

    ops = ReferenceOps()
    # the shared expert seated among the routed ones (glmrt.model.moe.SharedExpertSlot), as the
    # cuda-h200 kernel set runs it: per rank it is one more expert of the rank's I slice
    ops.fuse_shared_experts = job.get("fuse_shared_experts", False)
    if "checkpoint" in job:
        model, report = load_checkpoint(job["checkpoint"], ops, dtype=torch.float32, with_mtp=job["mtp"],
                                        parallel=parallel)
        return model, report.read_bytes
    config = preset_config(job["preset"])
    if job.get("attention_bias"):  # MLA biases (o_proj's: ROW-parallel) and the softplus KDA gate
        config = config.replace_text(attention_bias=True, linear_lower_bound=None)
    model = load_dummy(config, ops, dtype=torch.float32, seed=job["seed"],
                       quantization=job.get("quantization"), parallel=parallel)
    return model, 0


def run_job(job: dict, parallel) -> tuple[dict[str, torch.Tensor], list[str]]:
    """-> (the runs' tensors and the bytes of each parameter this rank holds, their names)."""
    model, read_bytes = load(job, parallel)
    vocab = model.config.text.vocab_size
    result = greedy_run(model, vocab)
    if job["mtp"]:
        result.update(mtp_run(model, vocab))
    names = sorted(n for n, _ in model.named_parameters())
    params = dict(model.named_parameters())
    result["param_bytes"] = torch.tensor([params[n].numel() * params[n].element_size() for n in names])
    result["read_bytes"] = torch.tensor([read_bytes])
    result["shared_slots"] = torch.tensor(sum(getattr(getattr(m, "shared_slot", None), "fused", False)
                                              for m in model.modules()))
    return result, names


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from glmrt.parallel import Parallel

    rank, world, init_file, jobs = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for job in jobs:
            parallel = Parallel(rank, world, job["ep_size"], dist.group.WORLD)
            result, names = run_job(job, parallel)
            save_file({k: v.contiguous() for k, v in result.items()}, f"{job['out']}.rank{rank}.safetensors",
                      metadata={"names": json.dumps(names)})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
