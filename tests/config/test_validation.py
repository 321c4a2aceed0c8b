"""The config tree's one validation pass: declared bounds, refusals that name the field the way
its source spells it, typed actor sections that survive the trip to an actor process, and the
table of actor kinds."""

from __future__ import annotations

import dataclasses
import datetime
import re

import pytest

from glmrt import env
from glmrt.actor_kinds import ENGINE_KINDS, KINDS, canonical_kind, kind_of
from glmrt.config_bounds import ConfigValueError, check_fields, flag_spelling
from glmrt.engine.config import EngineConfig
from glmrt.topology import ApiSection, TopologyError, default_topology, parse_topology
from glmrt.topology_checks import check_scale_request, validate, validate_scale

# (field, bad value, the requirement the refusal states)
BAD_ENGINE_VALUES = [
    ("schedule_policy", "random", "must be one of fcfs, lpm"),
    ("chunked_prefill_size", 0, "must be >= 1"),
    ("max_prefill_tokens", 0, "must be >= 1"),
    ("max_num_batched_tokens", 0, "must be >= 1"),
    ("mamba_full_memory_ratio", -0.5, "must be > 0"),
    ("max_running_requests", 0, "must be >= 1"),
    ("context_length", 0, "must be >= 1"),
    ("cuda_graph_max_bs", 0, "must be >= 1"),
    ("state_checkpoint_interval", -1, "must be >= 0"),
    ("max_mamba_cache_size", 0, "must be >= 1"),
    ("cuda_graph_warmup_tokens", -1, "must be >= 0"),
    ("mem_fraction_static", 1.0, "must be > 0 and < 1"),
    ("cache_memory_gb", 0.0, "must be > 0"),
    ("cache_memory_gb", float("inf"), "must be a finite number"),
    ("mamba_full_memory_ratio", float("inf"), "must be a finite number"),
    ("device", "tpu", "must be auto, cpu, cuda or cuda:N"),
    ("device", "cuda:x", "must be auto, cpu, cuda or cuda:N"),
    ("page_size", "big", "must be an integer"),
    ("page_size", True, "must be an integer"),
    ("disable_radix_cache", "yes", "must be true or false"),
    ("dtype", "fp32", "must be one of"),
    ("role", "router", "must be one of unified, prefill, decode"),
]


@pytest.mark.parametrize("name, value, requirement", BAD_ENGINE_VALUES)
def test_engine_config_refuses_values_outside_their_bounds(name, value, requirement):
    with pytest.raises(ConfigValueError) as e:
        EngineConfig(**{name: value})
    assert (e.value.name, e.value.value) == (name, value)
    assert str(e.value).startswith(f"{name} {requirement}")
    assert e.value.message(flag_spelling).startswith("--" + name.replace("_", "-") + " " + requirement)
    assert str(e.value).endswith(f"(got {value!r})")


@pytest.mark.parametrize("name, value", [("max_running_requests", None), ("context_length", None),
                                         ("state_checkpoint_interval", 0), ("cuda_graph_warmup_tokens", 0),
                                         ("mamba_full_memory_ratio", 3), ("schedule_policy", "lpm"),
                                         ("max_num_batched_tokens", 1)])
def test_engine_config_accepts_the_edges(name, value):
    assert getattr(EngineConfig(**{name: value}), name) == value


def test_every_engine_field_has_a_docstring():
    import ast
    import inspect

    import glmrt.engine.config as mod

    cls = next(n for n in ast.parse(inspect.getsource(mod)).body if isinstance(n, ast.ClassDef)
               and n.name == "EngineConfig")
    documented = {prev.target.id for prev, node in zip(cls.body, cls.body[1:])
                  if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    assert documented == set(EngineConfig.field_names())


GOOD = [{"kind": "tokenizer"}, {"kind": "engine"}, {"kind": "detokenizer"}]


@pytest.mark.parametrize("data, message", [
    ({"engine": {"chunked_prefill_size": 0}}, "[engine] chunked_prefill_size must be >= 1 (got 0)"),
    ({"engine": {"schedule_policy": "random"}}, "[engine] schedule_policy must be one of fcfs, lpm (got 'random')"),
    ({"engine": {"max_running_requests": 64, "max_num_batched_tokens": 32}}, "[engine] max_num_batched_tokens must "
     "be >= max_running_requests (64): a full decode batch alone would use it up (got 32)"),
    ({"engine": {"speculative_algorithm": "EAGLE", "max_num_batched_tokens": 3}}, "[engine] max_num_batched_tokens "
     "must be >= speculative_num_steps + 1 (4): one drafting decode alone would use it up (got 3)"),
    ({"model": {"load_format": "pt"}}, "[model] load_format must be one of auto, dummy (got 'pt')"),
    ({"api": {"port": 70000}}, "[api] port must be >= 0 and < 65536 (got 70000)"),
    ({"api": {"max_queued_requests": 0}}, "[api] max_queued_requests must be >= 1 (got 0)"),
    ({"api": {"limit_mm_per_prompt": {"image": -2}}}, "[api] limit_mm_per_prompt image must be an integer >= 0 "
     "(got -2)"),
    ({"api": {"limit_mm_per_prompt": 3}}, "[api] limit_mm_per_prompt must be a table such as {image = 8, video = 2} "
     "or its JSON text (got 3)"),
    ({"api": {"limit_mm_per_prompt": {"image": datetime.date(2026, 1, 1)}}}, "[api] limit_mm_per_prompt must be a "
     "table such as {image = 8, video = 2} or its JSON text (got {'image': datetime.date(2026, 1, 1)})"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "engine": {"context_length": 0}}, {"kind": "detokenizer"}]},
     "[[actors]] engine engine: context_length must be >= 1 (got 0)"),
])
def test_a_topology_file_is_refused_in_its_own_spelling(data, message):
    with pytest.raises(TopologyError) as e:
        parse_topology({"actors": GOOD, **data})
    assert str(e.value) == message


def test_media_limits_are_a_table_in_a_file_and_json_on_the_command_line():
    from glmrt.mm_limits import parse_mm_limits

    topo = parse_topology({"actors": GOOD, "api": {"limit_mm_per_prompt": {"image": 4}}})
    assert parse_mm_limits(topo.api.limit_mm_per_prompt) == {"image": 4, "video": 4}
    topo = dataclasses.replace(default_topology(), api=ApiSection(limit_mm_per_prompt='{"video": "2"}'))
    with pytest.raises(TopologyError, match=r"^--limit-mm-per-prompt video must be an integer >= 0 \(got '2'\)$"):
        validate(topo, flags=True)


def test_command_line_values_are_refused_in_flag_spelling():
    topo = dataclasses.replace(default_topology(), engine={"cuda_graph_max_bs": 0})
    with pytest.raises(TopologyError, match=r"^--cuda-graph-max-bs must be >= 1 \(got 0\)$"):
        validate(topo, flags=True)
    topo = dataclasses.replace(default_topology(), api=ApiSection(max_request_mb=-1.0))
    with pytest.raises(TopologyError, match=r"^--max-request-mb must be > 0 \(got -1.0\)$"):
        validate(topo, flags=True)


def test_prefill_and_decode_must_share_a_layout():
    actors = [{"kind": "tokenizer"}, {"kind": "prefill", "engine": {"page_size": 16}}, {"kind": "decode"},
              {"kind": "detokenizer"}]
    with pytest.raises(TopologyError, match="prefill and decode must agree on page_size: prefill 16, decode 64"):
        parse_topology({"actors": actors})


def test_engine_config_takes_role_and_vision_from_placement():
    topo = parse_topology({"actors": [
        {"kind": "tokenizer"}, {"kind": "vision"}, {"kind": "prefill"}, {"kind": "decode"}, {"kind": "detokenizer"}]})
    configs = topo.engine_configs()
    assert {k: c.role for k, c in configs.items()} == {"prefill": "prefill", "decode": "decode"}
    assert not any(c.load_vision for c in configs.values())
    assert default_topology().engine_config(default_topology().actor("engine")).load_vision


@pytest.mark.parametrize("key, value, why", [("role", "decode", "its entry's kind"), ("model", "/ckpt", "[model] path"),
                                            ("preset", "flash", "[model] preset")])
@pytest.mark.parametrize("where", ["[engine]", "[[actors]] entry 1 engine"])
def test_engine_fields_set_by_placement_or_the_model_section_are_refused_in_engine_tables(key, value, why, where):
    """Given there, they would be overwritten: the kind sets the role, [model] the checkpoint."""
    engine = {key: value}
    data = ({"engine": engine} if where == "[engine]" else
            {"actors": [{"kind": "tokenizer"}, {"kind": "engine", "engine": engine}, {"kind": "detokenizer"}]})
    with pytest.raises(TopologyError, match=rf"^'{key}' is not an engine flag in {re.escape(where)}: .*{re.escape(why)}"):
        parse_topology(data)


def test_scale_requests():
    topo = default_topology()
    assert validate_scale(topo, "unified", 2) == "engine"
    for kind, n, needle in (("vision", 2, "cannot scale"), ("sorcerer", 1, "cannot scale"),
                            ("engine", 0, "at least 1"), ("prefill", 1, "runs no 'prefill'"),
                            ("tokenizer", 100_000, "at most 64 replicas, got 100000")):
        with pytest.raises(ValueError, match=needle):
            validate_scale(topo, kind, n)
    assert check_scale_request("prefill", 1) == "prefill"   # a PD deployment could


def test_the_actor_kind_table():
    assert canonical_kind("unified") == "engine" and canonical_kind("gpu-thing") is None
    assert ENGINE_KINDS == ("engine", "prefill", "decode")
    assert {k.name for k in KINDS if k.uses_gpus} == {"vision", *ENGINE_KINDS}
    assert kind_of("prefill").engine_role == "prefill" and kind_of("tokenizer").engine_role is None
    with pytest.raises(TopologyError, match="tokenizer does not run a model and takes no GPUs"):
        parse_topology({"actors": [{"kind": "tokenizer", "gpus": [0]}, {"kind": "engine"}, {"kind": "detokenizer"}]})


def test_run_specs_round_trip_with_typed_sections(tmp_path):
    from actors.base import RunSpec, decode_run_specs, encode_run_specs
    from actors.supervisor import Supervisor

    topo = parse_topology({"engine": {"max_running_requests": 3, "dtype": "float16"}, "actors": [
        {"kind": "tokenizer"}, {"kind": "vision"}, {"kind": "prefill"}, {"kind": "decode"}, {"kind": "detokenizer"}]})
    sup = Supervisor(topo, str(tmp_path), "/models/m", vocab_size=512)
    try:
        runs = [RunSpec(a.kind, 0, str(tmp_path), sup._config(a), gpus=[0]) for a in topo.actors]
    finally:
        sup.inbox.close()
        sup.peers.close()
    text = encode_run_specs(runs)
    assert decode_run_specs(text) == runs
    by_kind = {r.kind: r.config for r in decode_run_specs(text)}
    assert by_kind["tokenizer"].vision_replicas == 1 and by_kind["tokenizer"].vocab_size == 512
    assert by_kind["decode"].engine == topo.engine_config(topo.actor("decode")).replace(model="/models/m")
    assert by_kind["decode"].engine.max_running_requests == 3
    assert by_kind["detokenizer"].model_path == "/models/m"
    assert by_kind["vision"].dtype == "float16"   # the engines' dtype, so both vision paths compute alike


def test_env_accessors(monkeypatch):
    for name in ("GLMRT_KV_CHECKSUM", "GLMRT_KV_TRANSFER", "GLMRT_SAMPLER_KERNEL", "GLMRT_URL", "GLMRT_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert (env.kv_checksum(), env.kv_transfer(), env.sampler_kernel()) == (False, "auto", True)
    assert (env.url(), env.api_key()) == ("http://127.0.0.1:30000", None)
    monkeypatch.setenv("GLMRT_KV_CHECKSUM", "1")
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "zmq")
    monkeypatch.setenv("GLMRT_SAMPLER_KERNEL", "0")
    assert (env.kv_checksum(), env.kv_transfer(), env.sampler_kernel()) == (True, "zmq", False)
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "carrier-pigeon")
    with pytest.raises(ValueError, match="GLMRT_KV_TRANSFER must be one of"):
        env.kv_transfer()


def test_check_fields_on_any_section():
    check_fields(ApiSection())
    with pytest.raises(ConfigValueError, match=r"mm_feature_transport must be one of cpu, cuda_ipc, auto"):
        check_fields(ApiSection(mm_feature_transport="rdma"))


def _build(argv: list[str]):
    from cli.main import build_parser
    from cli.up import build_topology

    return build_topology(build_parser().parse_args(["up", *argv]))


def test_flags_override_the_file_and_are_checked_once_merged(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text('[engine]\nmax_running_requests = 4\n[[actors]]\nkind = "tokenizer"\n[[actors]]\nkind = "prefill"\n'
                    '[[actors]]\nkind = "decode"\n[[actors]]\nkind = "detokenizer"\n')
    topo = _build([str(path), "--max-running-requests", "6", "--tokenizer-replicas", "2"])
    assert {c.max_running_requests for c in topo.engine_configs().values()} == {6}
    assert topo.actor("tokenizer").replicas == 2
    with pytest.raises(TopologyError, match=r"^--max-running-requests must be >= 1 \(got 0\)$"):
        _build([str(path), "--max-running-requests", "0"])
    with pytest.raises(TopologyError, match="--engine-replicas: the topology runs no 'engine' actor"):
        _build([str(path), "--engine-replicas", "2"])   # not accepted and ignored


def test_a_bad_kv_transfer_mode_is_refused_before_a_pd_deployment_starts(tmp_path, monkeypatch):
    path = tmp_path / "topology.toml"
    path.write_text('[[actors]]\nkind = "tokenizer"\n[[actors]]\nkind = "prefill"\n'
                    '[[actors]]\nkind = "decode"\n[[actors]]\nkind = "detokenizer"\n')
    monkeypatch.setenv("GLMRT_KV_TRANSFER", "nfs")
    with pytest.raises(TopologyError, match="GLMRT_KV_TRANSFER must be one of auto, nixl, zmq \\(got"):
        _build([str(path)])
    _build([])   # a unified engine hands nothing over: the variable is not read


def test_parallel_flags_set_every_engine_entry():
    topo = _build(["--tp-size", "2", "--ep-size", "2", "--dp-size", "3"])
    engine = topo.actor("engine")
    assert (engine.tp, engine.ep, engine.replicas) == (2, 2, 3)
    assert topo.actor("tokenizer").tp == 1
    assert _build(["--tp", "2"]).actor("engine").ep == 1
    assert _build(["--dp", "2", "--engine-replicas", "2"]).actor("engine").replicas == 2


def test_dp_size_needs_an_engine_entry(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text('[[actors]]\nkind = "tokenizer"\n[[actors]]\nkind = "prefill"\n'
                    '[[actors]]\nkind = "decode"\n[[actors]]\nkind = "detokenizer"\n')
    with pytest.raises(TopologyError, match="--dp-size: the topology runs no 'engine' actor"):
        _build([str(path), "--dp-size", "2"])


def test_sizes_the_model_does_not_divide_are_refused():
    from cli.up import check_parallel_shapes
    from glmrt.checkpoint.presets import preset_config

    tiny = preset_config("tiny")   # 4 heads, 8 experts, moe_intermediate_size 32
    assert check_parallel_shapes(_build(["--tp-size", "4", "--ep-size", "4"]), tiny) is None
    assert check_parallel_shapes(_build(["--tp-size", "3"]), tiny) == (
        "engine: tp (--tp-size) = 3 does not divide the model's num_attention_heads (4); pick a size that divides it")
    assert "num_attention_heads (4)" in check_parallel_shapes(_build(["--tp-size", "8", "--ep-size", "8"]), tiny)


def _over_nodes(nodes: dict, tp: int = 2) -> dict:
    return {"nodes": nodes, "actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": tp}, {"kind": "detokenizer"}]}


def test_a_nodes_section_is_read_checked_and_spells_its_keys():
    topo = parse_topology(_over_nodes({"nnodes": 2, "node_rank": 1, "dist_init_addr": "[::1]:29500",
                                       "curve_key_file": "~/k.key_secret"}, tp=4))
    assert (topo.nodes.nnodes, topo.nodes.node_rank, topo.nodes.dist_init_addr) == (2, 1, "[::1]:29500")
    assert not topo.nodes.curve_key_file.startswith("~")
    from glmrt.nodes import node_ranks, split_addr, tcp_url
    assert list(node_ranks(4, 2, 1)) == [2, 3] and split_addr("[::1]:29500") == ("::1", 29500)
    assert tcp_url("::1", "*") == "tcp://[::1]:*" and tcp_url("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    with pytest.raises(TopologyError, match=r"unknown key 'nodes' in \[nodes\]"):
        parse_topology(_over_nodes({"nodes": 2}))
    with pytest.raises(TopologyError, match=r"^\[nodes\] node_rank 2 is out of range for nnodes 2 \(0\.\.1\)$"):
        parse_topology(_over_nodes({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}))
    with pytest.raises(TopologyError, match=r"^\[nodes\] nnodes must be >= 1 \(got 0\)$"):
        parse_topology(_over_nodes({"nnodes": 0}))
    with pytest.raises(TopologyError, match=r"port 0 of 'h:0' is not in 1\.\.65535"):
        parse_topology(_over_nodes({"nnodes": 2, "dist_init_addr": "h:0"}))
    topo = parse_topology(_over_nodes({"nnodes": 2, "dist_init_addr": "h:1"}))
    with pytest.raises(ValueError, match="a deployment over 2 nodes runs one engine"):
        validate_scale(topo, "engine", 2)
    validate_scale(topo, "tokenizer", 2)


def test_an_engine_over_nodes_takes_its_nodes_share_of_gpus():
    from glmrt.topology_checks import place_parallel_engines
    data = _over_nodes({"nnodes": 2, "dist_init_addr": "h:1"}, tp=4)
    data["actors"][1]["gpus"] = [2, 3]  # tp 4 over 2 nodes: 2 GPUs on each
    validate(parse_topology(data), num_gpus=4)
    data["actors"][1]["gpus"] = [0, 1, 2, 3]
    with pytest.raises(TopologyError, match=r"1 replicas x tp 4 / 2 nodes need 2 gpus, one per rank"):
        parse_topology(data)
    del data["actors"][1]["gpus"]
    topo = place_parallel_engines(parse_topology(data), 8)
    assert topo.actor("engine").gpus == (0, 1)


@pytest.mark.parametrize("addr", ["0.0.0.0:5000", "0:5000", "[::]:5000", "[::ffff:0.0.0.0]:5000", "*:5000", ":5000"])
def test_every_spelling_of_all_interfaces_is_refused_as_the_link_host(addr):
    from glmrt.nodes import split_addr
    with pytest.raises(ValueError, match="names no host"):
        split_addr(addr)
    assert split_addr("127.0.0.1:5000") == ("127.0.0.1", 5000)
