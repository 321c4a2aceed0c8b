"""Tensor and expert parallelism: the sharded model computes what the whole model computes.

Two gloo rank processes (started once for the module, tests/model/tp_ranks.py) run the tiny
model in fp32 at TP2 and at TP2+EP2, from a checkpoint written by our writer, from FP8,
NVFP4 and MXFP4 checkpoints, from random weights (16-bit and FP8) and from a checkpoint
written by transformers' `save_pretrained`; this process runs the same steps at TP1. Greedy tokens (a mixed prefill of
three prompts, then batched decode) must be identical and max|Δlogit| / max|logit| <= 1e-5,
on both ranks (each returns the full logits); the transformers checkpoint must also give
transformers' own greedy tokens. Each rank must hold exactly its shard: 1/2 of every sharded
parameter plus every replicated one, and read only those bytes. TP4 / TP8 shapes are checked
in this process as rank 3 of a `fake` process group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)

from backends.reference import ReferenceOps  # noqa: E402
from glmrt.checkpoint.presets import preset_config  # noqa: E402
from glmrt.checkpoint.writer import write_checkpoint  # noqa: E402
from glmrt.model.glm5_next import Glm5NextForCausalLM  # noqa: E402
from glmrt.model.loader import build_model, default_fp8_modules, load_dummy  # noqa: E402
from glmrt.parallel import Parallel, Split  # noqa: E402
from tests.model import tp_ranks  # noqa: E402

TOL = 1e-5
WORLD = 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- which parameters are sharded, and along which dim (the spec, written out independently) ----

_TP_DIMS = [  # (pattern on our parameter name, dim split over the tensor-parallel ranks)
    (r"embed_tokens\.weight$|^lm_head\.weight$", 0),
    (r"self_attn\.(q|k|v|f_b|g_b|b)_proj\.weight$", 0),
    (r"self_attn\.(q|k|v)_conv1d\.weight$|self_attn\.(dt_bias|A_log)$", 0),
    (r"self_attn\.(q_b_proj|kv_b_proj)\.weight$", 0),
    (r"self_attn\.o_proj\.weight$", 1),
    (r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", 0),
    (r"mlp\.(shared_experts\.)?down_proj\.weight$", 1),
]


def split_dim(name: str, ep: bool) -> int | None:
    """The dim of the full tensor `name` that the ranks split, None if replicated."""
    if name.startswith("visual."):
        return None
    if ".mlp.experts." in name:
        if ep:
            return 0
        return 2 if ".down_proj." in name else 1
    for pattern, dim in _TP_DIMS:
        if re.search(pattern, name.replace("weight_scale_inv", "weight")):
            return dim
    return None


def expected_shape(name: str, full: tuple[int, ...], world: int, ep: bool) -> tuple[int, ...]:
    dim = split_dim(name, ep)
    if dim is None:
        return full
    assert full[dim] % world == 0, (name, full, world)
    return tuple(n // world if i == dim else n for i, n in enumerate(full))


# ---- the two rank processes, started once ----------------------------------------------------------

def _jobs(root) -> dict[str, dict]:
    base = {"mtp": True, "ep_size": 1}
    return {
        "tp2": {**base, "checkpoint": str(root / "f32")},
        "tp2_shared_slot": {**base, "checkpoint": str(root / "f32"), "fuse_shared_experts": True},
        "tp2ep2": {**base, "checkpoint": str(root / "f32"), "ep_size": WORLD},
        "fp8": {**base, "checkpoint": str(root / "fp8")},
        "fp8_ep2": {**base, "checkpoint": str(root / "fp8"), "ep_size": WORLD},
        "nvfp4": {**base, "checkpoint": str(root / "nvfp4")},
        "mxfp4_ep2": {**base, "checkpoint": str(root / "mxfp4"), "ep_size": WORLD},
        "dummy_ep2_bias": {**base, "preset": "tiny", "seed": 11, "ep_size": WORLD, "attention_bias": True},
        "dummy_fp8": {**base, "preset": "tiny", "seed": 12, "quantization": "fp8"},
        "hf": {**base, "checkpoint": str(root / "hf"), "mtp": False},
    }


def _hf_checkpoint(path) -> tuple[object, dict]:
    """A tiny model written by transformers' save_pretrained (weights from a random model of
    ours, so that greedy choices sit far apart), and the model transformers loads back from it."""
    from bench.hf_reference import build_hf_from_ours, import_hf_torch_kda

    import_hf_torch_kda()  # the CPU oracle keeps torch KDA even where fla-core is installed
    from transformers import Glm5NextForConditionalGeneration

    src = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.float32, seed=5)
    build_hf_from_ours(src, "cpu", torch.float32).save_pretrained(path)
    return Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{job: (TP1 result, [rank results], parameter names)}, the ranks' runs done in parallel
    with this process's TP1 runs."""
    from safetensors import safe_open

    root = tmp_path_factory.mktemp("tp")
    tiny = preset_config("tiny")
    write_checkpoint(tiny, str(root / "f32"), seed=3, dtype="float32", tokenizer=False, progress=False)
    for seed, fmt in enumerate(("fp8", "nvfp4", "mxfp4"), start=4):
        write_checkpoint(tiny, str(root / fmt), seed=seed, dtype=fmt, tokenizer=False, progress=False)
    hf = _hf_checkpoint(root / "hf")
    jobs = _jobs(root)
    for name, job in jobs.items():
        job["out"] = str(root / name)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    init = root / "pg-init"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.model.tp_ranks", str(r), str(WORLD), str(init),
                               json.dumps(list(jobs.values()))], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    try:
        single = {name: tp_ranks.run_job(job, Parallel.single()) for name, job in jobs.items()}
        for p in procs:
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, f"rank process failed:\n{out[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for name, job in jobs.items():
        ranks = []
        for r in range(WORLD):
            with safe_open(f"{job['out']}.rank{r}.safetensors", "pt") as f:
                names = json.loads(f.metadata()["names"])
                ranks.append({k: f.get_tensor(k) for k in f.keys()})
        results[name] = (single[name][0], ranks, names, single[name][1])
    results["_hf"] = hf
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("job", ["tp2", "tp2_shared_slot", "tp2ep2", "fp8", "fp8_ep2", "nvfp4", "mxfp4_ep2", "dummy_ep2_bias", "dummy_fp8", "hf"])
def test_sharded_model_matches_the_whole_model(runs, job):
    whole, ranks, _, _ = runs[job]
    logits = [k for k in whole if k.startswith(("prefill.", "decode.", "mtp"))]
    vocab = whole["prefill.0"].shape[-1]
    assert all(part["empty"].shape == (0, vocab) for part in ranks)
    assert any(k.startswith("decode.") for k in logits)
    assert ("mtp" in logits) == (job != "hf")
    moe_layers = sum(map(preset_config("tiny").text.is_moe, range(6))) + 1  # and the MTP layer's
    assert whole["shared_slots"].item() == (moe_layers if "slot" in job else 0)
    assert all(torch.equal(part["shared_slots"], whole["shared_slots"]) for part in ranks)
    worst = 0.0
    for rank, part in enumerate(ranks):
        assert torch.equal(part["tokens"], whole["tokens"]), (job, rank, part["tokens"], whole["tokens"])
        for k in logits:
            assert part[k].shape == whole[k].shape
            err = _rel(part[k], whole[k])
            assert err <= TOL, f"{job} rank {rank} {k}: max|Δ|/max = {err:.2e}"
            worst = max(worst, err)
    print(f"{job}: max|Δlogit|/max|logit| = {worst:.1e}")


def test_transformers_checkpoint_gives_transformers_greedy_tokens(runs):
    hf = runs["_hf"]
    _, ranks, _, _ = runs["hf"]
    vocab = preset_config("tiny").text.vocab_size
    want = []
    with torch.no_grad():
        for prompt in tp_ranks.prompts(vocab):
            seq = list(prompt)
            for _ in range(tp_ranks.DECODE_STEPS + 1):
                seq.append(int(hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            want.append(seq[len(prompt):])
    assert ranks[0]["tokens"].tolist() == want
    assert ranks[1]["tokens"].tolist() == want


@pytest.mark.parametrize("job,ep", [("tp2", False), ("tp2ep2", True)])
def test_each_rank_holds_and_reads_only_its_shard(runs, job, ep):
    whole, ranks, names, whole_names = runs[job]
    full = dict(zip(whole_names, whole["param_bytes"].tolist()))
    assert names == whole_names
    total = sum(full.values())
    replicated = sum(b for n, b in full.items() if split_dim(n, ep) is None)
    for part in ranks:
        held = dict(zip(names, part["param_bytes"].tolist()))
        for n, b in held.items():
            assert b == (full[n] if split_dim(n, ep) is None else full[n] // WORLD), n
        assert sum(held.values()) == replicated + (total - replicated) // WORLD
        assert part["read_bytes"].item() == sum(held.values())  # an fp32 checkpoint into fp32 parameters
    assert replicated < 0.5 * total  # the sharded weights are most of the model


# ---- TP4 / TP8 shapes as rank 3 of a fake group ---------------------------------------------------

@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int):
        dist.init_process_group("fake", rank=3, world_size=world, store=FakeStore())
        return dist.group.WORLD

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,ep,fp8", [(4, False, False), (8, False, True), (8, True, True)])
def test_flash_shards_at_tp4_and_tp8(fake_group, world, ep, fp8):
    group = fake_group(world)
    cfg = preset_config("flash")
    fp8_modules = default_fp8_modules(cfg, torch.bfloat16) if fp8 else ()
    full = _shapes(build_model(cfg, None, torch.bfloat16, "meta", fp8_modules=fp8_modules))
    p = Parallel(3, world, world if ep else 1, group)
    part = _shapes(build_model(cfg, None, torch.bfloat16, "meta", fp8_modules=fp8_modules, parallel=p))
    assert part.keys() == full.keys()
    for name, shape in full.items():
        if name.endswith("weight_scale_inv"):
            w = expected_shape(name[: -len("_scale_inv")], full[name[: -len("_scale_inv")]], world, ep)
            want = (*w[:-2], -(-w[-2] // 128), -(-w[-1] // 128))
        else:
            want = expected_shape(name, shape, world, ep)
        assert part[name] == want, (name, part[name], want)
    t = cfg.text
    layer = t.dsa_layers[0]
    assert part[f"model.layers.{layer}.self_attn.q_b_proj.weight"][0] == t.num_attention_heads // world * t.qk_head_dim


def test_a_tp4_rank_runs_a_step_at_its_shapes(fake_group):
    """A forward at TP4 (rank 3 of a fake group: collectives do nothing) runs every op at the
    per-rank shapes (1 KDA and 1 MLA head, 2 experts, 256 of the vocab) and returns full logits."""
    group = fake_group(4)
    model = load_dummy(preset_config("tiny"), ReferenceOps(), dtype=torch.float32, seed=1,
                       parallel=Parallel(3, 4, 4, group))
    kda = model.model.layers[0].self_attn
    assert (kda.num_heads, model.model.layers[1].self_attn.num_heads) == (1, 1)
    assert model.model.layers[2].mlp.experts.gate_proj.weight.shape[0] == 2
    assert model.model.embed_tokens.weight.shape[0] == 256
    result = tp_ranks.greedy_run(model, 1024)
    assert result["prefill.0"].shape == (tp_ranks.PROMPT_LENS[0], 1024)


def test_a_shape_that_does_not_divide_is_refused(fake_group):
    group = fake_group(8)
    with pytest.raises(ValueError, match=r"linear_num_heads \(4\) is not divisible by 8 ranks"):
        with torch.device("meta"):
            Glm5NextForCausalLM(preset_config("tiny"), None, torch.float32, parallel=Parallel(3, 8, 1, group))


def test_a_shard_splitting_an_fp8_block_is_refused(fake_group):
    group = fake_group(8)
    cfg = preset_config("flash-4l").replace_text(moe_intermediate_size=1536)  # 192 rows a rank
    with pytest.raises(ValueError, match="split a 128-wide FP8 scale block"):
        build_model(cfg, None, torch.bfloat16, "meta", fp8_modules=default_fp8_modules(cfg, torch.bfloat16),
                    parallel=Parallel(3, 8, 1, group))


def test_scale_split_follows_its_weight():
    assert Split(0, 256, 256, 2048).scale_split(128, "w") == Split(0, 2, 2, 16)
    assert Split(0, 24, 8, 64).scale_split(128, "w") == Split(0, 0, 1, 1)  # inside one block: shares it
    with pytest.raises(ValueError, match="split a 128-wide"):
        Split(0, 192, 192, 1536).scale_split(128, "w")
