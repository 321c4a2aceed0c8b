"""Topology files: schema, defaults, overrides and refusals with messages naming the key."""

from __future__ import annotations

import pytest

from glmrt.topology import TopologyError, default_topology, parse_topology
from glmrt.topology_checks import validate


def test_default_is_one_of_each():
    t = default_topology()
    assert [(a.kind, a.replicas) for a in t.actors] == [("tokenizer", 1), ("engine", 1), ("detokenizer", 1)]


def test_full_file_parses_with_overrides():
    t = parse_topology({
        "model": {"path": "/m", "dtype": "bfloat16"},
        "engine": {"chunked_prefill_size": 512, "mamba_full_memory_ratio": 0.5},
        "api": {"host": "127.0.0.1", "port": 31000},
        "actors": [{"kind": "tokenizer", "replicas": 2}, {"kind": "unified", "engine": {"page_size": 16}},
                   {"kind": "detokenizer"}],
    })
    assert t.actor("tokenizer").replicas == 2 and t.actor("engine") is not None
    cfg = t.engine_config(t.actor("engine"))
    assert (cfg.model, cfg.dtype, cfg.chunked_prefill_size, cfg.page_size) == ("/m", "bfloat16", 512, 16)
    assert t.api.port == 31000


@pytest.mark.parametrize("data, needle", [
    ({"modle": {}}, "modle"),
    ({"model": {"pth": "x"}}, "pth"),
    ({"engine": {"chunk_size": 1}}, "chunk_size"),
    ({"actors": [{"kind": "tokenizer", "replica": 2}]}, "replica"),
    ({"actors": [{"kind": "gpu-thing"}]}, "gpu-thing"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "prefill"}, {"kind": "detokenizer"}]}, "'decode' actor is missing"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine"}, {"kind": "prefill"}, {"kind": "decode"},
                 {"kind": "detokenizer"}]}, "not both"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 0}, {"kind": "detokenizer"}]}, "tp must be >= 1"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 2, "ep": 3}, {"kind": "detokenizer"}]},
     r"engine: ep = 3 must be 1 or tp \(2\)"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "ep": 2}, {"kind": "detokenizer"}]},
     r"ep = 2 must be 1 or tp \(1\)"),
    ({"actors": [{"kind": "tokenizer", "tp": 2}, {"kind": "engine"}, {"kind": "detokenizer"}]},
     "tokenizer does not run a model"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 2, "replicas": 2, "gpus": [0, 1, 2]},
                 {"kind": "detokenizer"}]}, r"2 replicas x tp 2 need 4 gpus, one per rank; got gpus = \[0, 1, 2\]"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 2, "gpus": [1, 1]}, {"kind": "detokenizer"}]},
     "lists a GPU twice"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "prefill", "tp": 2, "process": "pd"}, {"kind": "decode", "tp": 2},
                 {"kind": "detokenizer"}]},
     "prefill: process = 'pd' co-locates actors in one process; an engine of tp 2 runs 2 processes"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "prefill", "tp": 2}, {"kind": "decode"}, {"kind": "detokenizer"}]},
     "prefill tp = 2 and decode tp = 1 differ: .* resharding between tp sizes is not built"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "prefill"}, {"kind": "decode", "tp": 4}, {"kind": "detokenizer"}]},
     "prefill tp = 1 and decode tp = 4 differ"),
    ({"actors": [{"kind": "tokenizer"}, {"kind": "detokenizer"}]}, "engine"),
    ({"actors": [{"kind": "tokenizer", "gpus": [0]}, {"kind": "engine"}, {"kind": "detokenizer"}]}, "GPUs"),
    ({"actors": [{"kind": "engine"}, {"kind": "engine"}, {"kind": "tokenizer"}, {"kind": "detokenizer"}]},
     "listed 2 times"),
])
def test_refusals_name_the_problem(data, needle):
    with pytest.raises(TopologyError, match=needle):
        parse_topology(data)


def test_tp_ranks_are_placed_on_gpus():
    from glmrt.topology_checks import place_parallel_engines

    t = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 2, "ep": 2, "replicas": 2,
                                                                 "gpus": [4, 5, 6, 7]}, {"kind": "detokenizer"}]})
    assert (t.actor("engine").tp, t.actor("engine").ep) == (2, 2)
    validate(t, num_gpus=8)
    with pytest.raises(TopologyError, match="gpu 4 does not exist"):
        validate(t, num_gpus=4)
    bare = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 4}, {"kind": "detokenizer"}]})
    with pytest.raises(TopologyError, match="1 replicas x tp 4 need 4 GPUs, one per rank; this machine has 2"):
        validate(bare, num_gpus=2)
    assert place_parallel_engines(bare, 4).actor("engine").gpus == (0, 1, 2, 3)
    assert place_parallel_engines(bare, 0).actor("engine").gpus == ()   # the CPU: no GPUs to place


def test_scaling_an_engine_of_several_ranks_needs_their_gpus():
    from glmrt.topology_checks import validate_scale

    t = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "tp": 2, "gpus": [0, 1, 2, 3],
                                    "replicas": 2}, {"kind": "detokenizer"}]})
    assert validate_scale(t, "engine", 1) == "engine"
    with pytest.raises(ValueError, match=r"3 replicas x tp 2 need 6 GPUs, one per rank; its entry lists 4"):
        validate_scale(t, "engine", 3)


def test_gpu_that_does_not_exist():
    t = parse_topology({"actors": [{"kind": "tokenizer"}, {"kind": "engine", "gpus": [3]}, {"kind": "detokenizer"}]})
    with pytest.raises(TopologyError, match="gpu 3 does not exist"):
        validate(t, num_gpus=1)
