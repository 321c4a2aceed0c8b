"""The [log] section of the config tree: its flags and keys, their bounds, checked in the one
validation pass, and the typed sections that carry them to the actor processes."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from glmrt.actor_config import ActorLogConfig
from glmrt.topology import LogSection, TopologyError, default_topology, parse_topology
from glmrt.topology_checks import validate

ACTORS = [{"kind": "tokenizer"}, {"kind": "engine"}, {"kind": "detokenizer"}]


def test_log_defaults_and_file_values():
    assert default_topology().log == LogSection("info", 10.0, False)
    topo = parse_topology({"log": {"log_level": "debug", "log_interval": 0, "disable_log_requests": True},
                           "actors": ACTORS})
    assert topo.log == LogSection("debug", 0, True)


@pytest.mark.parametrize("table, line", [
    ({"log_level": "verbose"}, "[log] log_level must be one of debug, info, warning, error (got 'verbose')"),
    ({"log_level": "INFO"}, "[log] log_level must be one of debug, info, warning, error (got 'INFO')"),
    ({"log_interval": -1}, "[log] log_interval must be >= 0 (got -1)"),
    ({"log_interval": "10s"}, "[log] log_interval must be a number (got '10s')"),
    ({"disable_log_requests": "yes"}, "[log] disable_log_requests must be true or false (got 'yes')"),
])
def test_bad_log_values_are_refused_naming_the_key(table, line):
    with pytest.raises(TopologyError) as e:
        parse_topology({"log": table, "actors": ACTORS})
    assert str(e.value) == line


def test_unknown_log_key_is_refused():
    with pytest.raises(TopologyError, match="unknown key 'level' in \\[log\\]; known: disable_log_requests, "
                                            "log_interval, log_level"):
        parse_topology({"log": {"level": "info"}, "actors": ACTORS})


def test_a_bad_flag_is_spelled_as_the_flag():
    topo = dataclasses.replace(default_topology(), log=LogSection(log_interval=-0.5))
    with pytest.raises(TopologyError, match=r"^--log-interval must be >= 0 \(got -0.5\)$"):
        validate(topo, flags=True)


def test_flags_override_the_file(tmp_path):
    from cli import up
    from cli.parsing import GlmrtParser

    path = tmp_path / "topology.toml"
    path.write_text('[log]\nlog_level = "debug"\nlog_interval = 3\n')
    parser = GlmrtParser(prog="glmrt")
    up.add_parser(parser.add_subparsers())
    args = parser.parse_args(["up", str(path), "--log-interval", "0.5", "--disable-log-requests"])
    assert isinstance(args, argparse.Namespace)
    assert up.build_topology(args).log == LogSection("debug", 0.5, True)


def test_every_actor_process_is_handed_the_level_and_engines_the_interval(tmp_path):
    from actors.base import decode_run_specs, encode_run_specs
    from actors.supervisor import Supervisor

    topo = parse_topology({"log": {"log_level": "warning", "log_interval": 2.5}, "actors": ACTORS})
    sup = Supervisor(topo, str(tmp_path), "/models/m", vocab_size=512)
    try:
        runs = [sup._run_spec(a, 0, []) for a in topo.actors]
    finally:
        sup.inbox.close()
        sup.peers.close()
    decoded = decode_run_specs(encode_run_specs(runs))
    assert decoded == runs and {r.log for r in decoded} == {ActorLogConfig("warning")}
    assert next(r for r in decoded if r.kind == "engine").config.log_interval == 2.5
