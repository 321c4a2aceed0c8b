"""Will it fit: one rank's weights, reserves and pools (glmrt.engine.fit) for the full model at
TP4 / TP8, bf16 and fp8, against docs/MODEL.md §10 and the meta-built shards; and `glmrt up`'s
refusal, with the numbers, of an engine its GPU (or --cache-memory-gb) cannot hold."""

from __future__ import annotations

import json

import pytest
import torch

from cli import up
from glmrt.cache.layout import CacheLayout
from glmrt.checkpoint.presets import preset_config
from glmrt.devices import gpu_count
from glmrt.engine.config import EngineConfig
from glmrt.engine.fit import GB, GIB, RUNTIME_RESERVE_BYTES, engine_fit, plan_fit, shard_weight_bytes
from glmrt.engine.memory import plan_memory
from glmrt.topology import ActorSpec, ModelSection, Topology
from tests.cli.test_up_flags import glmrt_run, one_line_refusal

torch.set_num_threads(1)
H200 = int(141 * GB)


@pytest.fixture(scope="module")
def flash():
    return preset_config("flash")


@pytest.fixture(scope="module")
def weights(flash):
    """The engine's shards (no MTP, with vision) at TP1 / TP4 / TP8, bf16 and fp8."""
    return {(tp, ep, fp8): shard_weight_bytes(flash, fp8=fp8, tp_size=tp, ep_size=ep)
            for tp, ep, fp8 in ((1, 1, False), (4, 1, False), (4, 1, True), (8, 1, False), (8, 8, True))}


def test_the_tp8_shard_is_docs_per_rank_figure(flash):
    # docs/MODEL.md §10: bf16 weights without vision, 75.3 GiB a rank of 597.5 GiB at TP8
    full = shard_weight_bytes(flash, with_vision=False, with_mtp=True)
    rank = shard_weight_bytes(flash, with_vision=False, with_mtp=True, tp_size=8)
    assert round(full / GIB, 1) == 597.5 and round(rank / GIB, 1) == 75.3


def test_shards_split_the_model_and_fp8_halves_it(weights):
    one = weights[(1, 1, False)]
    for tp in (4, 8):
        # every rank holds 1/tp of the sharded weights plus the replicated ones (vision, norms, latent projections)
        assert one / tp < weights[(tp, 1, False)] < one / tp * 1.05
    assert 0.45 < weights[(4, 1, True)] / weights[(4, 1, False)] < 0.55
    assert weights[(8, 8, True)] < weights[(4, 1, True)] / 1.9


def test_the_plan_is_the_engines_budget_carved_by_plan_memory(flash, weights):
    cfg = EngineConfig(load_format="dummy", preset="flash")
    plan = engine_fit(flash, cfg, gpu_bytes=H200, kv_dtype="bfloat16", tp_size=8)
    assert plan.fits and plan.weight_bytes == weights[(8, 1, False)]
    free = H200 - plan.weight_bytes - RUNTIME_RESERVE_BYTES
    assert plan.budget_bytes == int(free * cfg.mem_fraction_static)
    assert plan.activation_reserve == free - plan.budget_bytes
    layout = CacheLayout.from_config(flash.text, tp_size=8)
    assert layout.kv_bytes_per_token == 11_440 and layout.state_bytes_per_slot == 18_550_784  # MODEL.md §10
    assert plan.memory == plan_memory(layout, plan.budget_bytes)
    assert plan.memory.kv_bytes + plan.memory.state_bytes <= plan.budget_bytes
    assert plan.context_length == flash.text.max_position_embeddings <= plan.memory.kv_tokens


def test_fp8_at_tp4_fits_and_bf16_does_not(flash, weights):
    fp8 = engine_fit(flash, EngineConfig(load_format="dummy", quantization="fp8"), gpu_bytes=H200,
                     kv_dtype="bfloat16", tp_size=4)
    assert fp8.fits and fp8.weight_bytes == weights[(4, 1, True)] and fp8.memory.max_running_requests == 256
    bf16 = engine_fit(flash, EngineConfig(load_format="dummy"), gpu_bytes=H200, kv_dtype="bfloat16", tp_size=4)
    assert not bf16.fits and bf16.memory is None
    assert bf16.refusal == (f"weights {weights[(4, 1, False)] / GIB:.2f} GiB + runtime reserve 1.00 GiB exceed "
                            f"the GPU's {H200 / GIB:.2f} GiB")


def test_a_context_length_the_kv_pool_cannot_hold_is_refused(flash):
    layout = CacheLayout.from_config(flash.text, tp_size=8)
    kw = dict(max_position_embeddings=flash.text.max_position_embeddings)
    plan = plan_fit(layout, 120 * GIB, H200, **kw)
    assert plan.fits and plan.context_length == plan.memory.kv_tokens < flash.text.max_position_embeddings
    tight = plan_fit(layout, 120 * GIB, H200, context_length=plan.memory.kv_tokens + 1, **kw)
    assert not tight.fits and "less than one request of context_length" in tight.refusal
    assert f"{plan.memory.kv_tokens:,} tokens" in tight.refusal
    tiny = plan_fit(layout, H200 - RUNTIME_RESERVE_BYTES - 2**20, H200, **kw)
    assert not tiny.fits and "too small" in tiny.refusal


def _flash_topology(tp: int, quantization: str | None = None) -> Topology:
    return Topology(model=ModelSection(load_format="dummy", preset="flash", quantization=quantization),
                    actors=(ActorSpec("tokenizer"), ActorSpec("engine", tp=tp, gpus=tuple(range(tp))),
                            ActorSpec("detokenizer")))


def test_up_refuses_flash_at_tp1_on_an_h200_and_takes_tp8(flash):
    """Through up's check and its child interpreter, with the GPUs' free memory given."""
    free = lambda gpus: {g: H200 - 2**30 * g for g in gpus}  # noqa: E731
    seen = []

    def fit(cfg, gpu_bytes, tp, ep):
        seen.append((cfg.quantization, gpu_bytes, tp, ep))
        return engine_fit(flash, cfg, gpu_bytes=gpu_bytes, kv_dtype="bfloat16", tp_size=tp, ep_size=ep).as_dict()

    refusal = up.check_memory_fit(_flash_topology(1), flash, num_gpus=8, free_bytes=free, fit=fit)
    assert refusal.startswith("engine (tp 1, ep 1) does not fit on GPU 0: weights ") and "exceed" in refusal
    assert up.check_memory_fit(_flash_topology(8), flash, num_gpus=8, free_bytes=free, fit=fit) is None
    assert up.check_memory_fit(_flash_topology(4, "fp8"), flash, num_gpus=8, free_bytes=free, fit=fit) is None
    # the ranks agree on the smallest budget: the GPU with the least free memory counts
    assert seen == [(None, H200, 1, 1), (None, H200 - 7 * 2**30, 8, 1), ("fp8", H200 - 3 * 2**30, 4, 1)]
    # memory that cannot be read is left to the engine's own check before it loads
    assert up.check_memory_fit(_flash_topology(1), flash, num_gpus=8, free_bytes=lambda g: None) is None


@pytest.mark.skipif(gpu_count() > 0, reason="a CPU engine's budget: on a GPU machine the engine takes a GPU")
def test_up_refuses_a_cache_budget_below_one_request_in_one_line(tmp_path):
    from glmrt.checkpoint.writer import checkpoint_config
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config(preset_config("tiny"), "float32").to_dict()))
    line = one_line_refusal(glmrt_run("up", "--model", str(tmp_path), "--port", "0",
                                      "--cache-memory-gb", "0.00001"))
    assert line.startswith("glmrt up: error: engine (tp 1, ep 1): --cache-memory-gb 1e-05: cache budget 0.0 MiB "
                           "is too small: one state slot needs"), line


def test_the_fit_module_runs_as_up_runs_it(flash):
    """`python -m glmrt.engine.fit` in a child interpreter: flash at TP1 on one H200, refused."""
    plan = up._fit_in_child(EngineConfig(load_format="dummy", preset="flash"), H200, 1, 1)
    assert plan["weight_bytes"] == shard_weight_bytes(flash) and plan["memory"] is None
    assert plan["refusal"] == (f"weights {plan['weight_bytes'] / GIB:.2f} GiB + runtime reserve 1.00 GiB exceed "
                               f"the GPU's {H200 / GIB:.2f} GiB")


def test_an_engine_refuses_before_it_loads(monkeypatch):
    """The engine's check on a GPU, with the GPU's free memory given: flash at TP1 on one H200."""
    from glmrt.engine.fit import check_engine_fits
    from glmrt.parallel import Parallel

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (H200, H200))
    cfg = EngineConfig(load_format="dummy", preset="flash")
    with pytest.raises(ValueError, match=r"^rank 0: the model does not fit on cuda: weights [\d.]+ GiB \+ runtime"):
        check_engine_fits(cfg, device="cuda", kv_dtype="bfloat16", parallel=Parallel.single())
    # rank 3 of an EP8 engine: its shard fits
    check_engine_fits(cfg, device="cuda", kv_dtype="bfloat16", parallel=Parallel(3, 8, 8, None))
