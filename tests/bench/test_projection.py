"""bench.projection: its per-rank counts against glmrt's own model, the floor it shares with the
decode benches, the collective tables, and its refusals."""

from __future__ import annotations

import json
import re

import pytest

from bench.h200 import CEILING_TBPS
from bench.projection import Collectives, main
from bench.projection_parts import rank_model, step_bytes
from glmrt.checkpoint.presets import preset_config

# What the layers' docstrings say every rank holds whole (glmrt/model/*.py): norms, mHC mixes, the
# router, the whole indexer, q_a / kv_a, KDA's low-rank f_a / g_a and o_norm, MTP's eh_proj.
REPLICATED = re.compile(r"(norm|\.hc_|mlp\.gate\.|\.indexer\.|q_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj|"
                        r"eh_proj|e_score_correction_bias)")


@pytest.fixture(scope="module")
def flash():
    return preset_config("flash")


@pytest.fixture(scope="module")
def ranks(flash):
    """(tp, ep, quantization) -> rank 0 of flash, each built once."""
    built = {}

    def get(tp, ep, quant="bf16"):
        if (tp, ep, quant) not in built:
            built[(tp, ep, quant)] = rank_model(flash, tp, ep, quant)
        return built[(tp, ep, quant)]
    return get


@pytest.fixture(scope="module")
def whole(ranks):
    return ranks(1, 1)


def test_flash_parameter_count_and_experts(flash, whole):
    t = flash.text
    assert abs(whole.params - 321e9) / 321e9 < 0.01
    moe_layers = sum(t.is_moe(i) for i in range(t.num_hidden_layers)) + 1  # + the MTP layer
    experts = sum(p.expert_bytes for p in whole.parts)
    assert experts == moe_layers * t.n_routed_experts * 3 * t.hidden_size * t.moe_intermediate_size * 2
    # TP1: the parts cover every stored tensor once (fp32 mHC, conv, gate and router-bias tensors
    # included), the embedding (rows only, no FLOPs) beside them
    embed = t.vocab_size * t.hidden_size * 2
    assert sum(p.dense_bytes + p.expert_bytes for p in whole.parts) + embed == whole.weight_bytes
    assert whole.weight_bytes == sum(p.numel() * p.element_size() for p in whole.model.parameters())
    assert whole.head().dense_bytes >= t.vocab_size * t.hidden_size * 2  # the LM head
    assert whole.replicated_bytes == 0


@pytest.mark.parametrize("tp,ep", [(4, 1), (8, 8)])
def test_ranks_share_the_model_except_what_the_code_replicates(ranks, whole, tp, ep):
    from glmrt.model.loader import param_splits

    whole = whole.weight_bytes
    rm = ranks(tp, ep)
    assert rm.weight_bytes * tp >= whole
    assert rm.weight_bytes * tp == whole + (tp - 1) * rm.replicated_bytes
    params = dict(rm.model.named_parameters())
    held_whole = {n for n, s in param_splits(rm.model).items() if s is None}
    assert {n for n in params if REPLICATED.search(n)} == held_whole
    assert sum(params[n].numel() * params[n].element_size() for n in held_whole) == rm.replicated_bytes


def test_fp8_keeps_what_glmrt_keeps_and_tp4_bf16_does_not_fit(ranks):
    from bench.projection import memory

    args = type("A", (), {"mem_fraction": 0.9, "context": 4096})()
    bf16, fp8 = ranks(4, 1), ranks(4, 1, "fp8")
    assert not memory(bf16, args)["fits"]
    m = memory(fp8, args)
    assert m["fits"] and m["requests_4k"] > 128
    assert fp8.weight_bytes < 0.55 * bf16.weight_bytes
    assert fp8.mtp().elems_fp8 == 0 and fp8.head().elems_fp8 == 0  # MTP layer and LM head stay bf16


@pytest.mark.parametrize("b,ctx", [(1, 40), (5, 100)])
def test_tp1_floor_is_decode_overlap_floor_bytes(b, ctx):
    from backends.reference import ReferenceOps
    from bench.decode_profile import _floor
    from glmrt.model.loader import load_dummy

    cfg = preset_config("tiny")
    model = load_dummy(cfg, ReferenceOps(), with_mtp=False, with_vision=False)
    want = _floor(model, b, ctx) * 1e-3 * CEILING_TBPS * 1e12
    rm = rank_model(cfg, 1, 1, "bf16")
    got = sum(step_bytes(rm, p, b, ctx) for p in rm.target())
    assert got == pytest.approx(want, rel=1e-9)


def test_collective_tables_interpolate_and_refuse(tmp_path):
    n, tables = Collectives.parse({"ranks": 4, "allreduce": [[2000, 20], [1000, 10], [4000, 24]]})
    links = Collectives()
    links.tables[("allreduce", n)] = tables["allreduce"]
    assert links.us("allreduce", 4, 1500) == pytest.approx(15)
    assert links.us("allreduce", 4, 10) == pytest.approx(10)      # below the first point: its time
    assert links.us("allreduce", 4, 6000) == pytest.approx(28)    # above: the last segment's slope
    assert links.us("all_gather", 4, 3000) == pytest.approx(15)   # half an all-reduce's bytes
    assert links.source("all_gather", 4).startswith("the measured all-reduce")
    assert links.source("allreduce", 8).startswith("assumed")     # other group sizes keep the assumptions
    assert links.us("allreduce", 8, 0) == pytest.approx(10.1)      # the published points up to 1 MiB,
    assert links.us("allreduce", 8, 2 << 20) == pytest.approx(45.0 + (1 << 20) * 1.75 / 400e3)  # then busbw
    assert links.us("all_gather", 8, 4e6) == pytest.approx(10 + 4e6 * 0.875 / 400e3)
    for bad in ({"allreduce": [[1, 1]]}, {"ranks": 4, "all_to_all": [[1, 1]], "allreduce": [[1, 1]]},
                {"ranks": 4, "allreduce": []}, {"ranks": 4, "allreduce": [[1, 1], [1, 2]]}):
        with pytest.raises(ValueError):
            Collectives.parse(bad)


def test_cli_measured_collectives_change_the_step_and_bad_values_exit_2(tmp_path, capsys):
    argv = ["--preset", "tiny", "--configs", "TP2,TP2+EP2", "--quantization", "bf16", "--batches", "1,4",
            "--context", "64"]
    base = main(argv)
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"ranks": 2, "allreduce": [[0, 100.0], [1 << 20, 200.0]]}))
    slow = main(argv + ["--collectives", str(f)])
    assert "measured" in capsys.readouterr().out
    for a, s in zip(base, slow):
        assert s["coll_ms"] > a["coll_ms"] and s["ms"] - a["ms"] == pytest.approx(s["coll_ms"] - a["coll_ms"])
        assert s["tok_s"] == pytest.approx(a["batch"] / s["ms"] * 1e3)
    for bad in (["--configs", "TP4+EP2"], ["--configs", "TP16"], ["--accept-length", "7"], ["--quantization", "fp4"],
                ["--batches", "0"], ["--collectives", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as e:
            main(["--preset", "tiny"] + bad)
        assert e.value.code == 2
