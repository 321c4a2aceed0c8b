"""`glmrt up`'s command line through the console script: the flags of SGLang's recipes refused in
one line saying what glmrt does instead (cli/peer_flags.py), no prefix abbreviations, a help text
with its default for every flag, `glmrt --version`. Nothing here starts an actor."""

from __future__ import annotations

import argparse
import subprocess

import pytest

import glmrt
from cli import up
from cli.parsing import GlmrtParser
from cli.peer_flags import PEER_FLAGS
from tests.e2e.conftest import REPO, clean_env, glmrt_cmd


def glmrt_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(glmrt_cmd() + list(args), cwd=str(REPO), env=clean_env(), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def one_line_refusal(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("glmrt up: error: "), r.stderr
    return lines[0]


def _refused_value(row) -> list[str]:
    return [] if not row.takes_value else ["8" if not row.accepts or row.accepts[0].isdigit() else "other"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("row", PEER_FLAGS, ids=[row.names[0] for row in PEER_FLAGS])
def test_a_recipe_flag_is_refused_saying_what_glmrt_does(row):
    for name in row.names:
        line = one_line_refusal(glmrt_run("up", name, *_refused_value(row)))
        assert line == f"glmrt up: error: {name}: {row.instead}"
        assert "unrecognized" not in line


@pytest.mark.timeout(60)
def test_values_naming_what_glmrt_does_are_accepted():
    accepted = [arg for row in PEER_FLAGS for value in row.accepts for arg in (row.names[0], value)]
    assert "--tool-call-parser" in accepted and "--reasoning-parser" in accepted
    # every accepted value passes; the refusal is the bad engine value after them
    line = one_line_refusal(glmrt_run("up", *accepted, "--page-size", "0"))
    assert line == "glmrt up: error: --page-size must be >= 1 (got 0)"


@pytest.mark.timeout(60)
def test_no_prefix_abbreviations():
    line = one_line_refusal(glmrt_run("up", "--disable-cuda"))   # not --disable-cuda-graph
    assert line == "glmrt up: error: unrecognized arguments: --disable-cuda (see glmrt up --help)"
    line = one_line_refusal(glmrt_run("up", "--chunked-prefill=0"))   # not --chunked-prefill-size
    assert line == "glmrt up: error: unrecognized arguments: --chunked-prefill=0 (see glmrt up --help)"


@pytest.mark.timeout(60)
def test_an_unknown_flag_is_one_line():
    line = one_line_refusal(glmrt_run("up", "--no-such-flag"))
    assert line == "glmrt up: error: unrecognized arguments: --no-such-flag (see glmrt up --help)"


def _up_parser() -> argparse.ArgumentParser:
    sub = GlmrtParser(prog="glmrt").add_subparsers()
    up.add_parser(sub)
    return sub.choices["up"]


def test_every_up_flag_has_a_help_text_with_its_default():
    peers = {name for row in PEER_FLAGS for name in row.names}
    checked = 0
    for action in _up_parser()._actions:
        names = set(action.option_strings)
        if not names or names & peers or isinstance(action, argparse._HelpAction):
            continue
        assert action.help and "(default: " in action.help, (action.option_strings, action.help)
        checked += 1
    assert checked > 40
    assert "(default: 30000)" in next(a.help for a in _up_parser()._actions if "--port" in a.option_strings)
    assert "(default: 64)" in next(a.help for a in _up_parser()._actions if "--page-size" in a.option_strings)


@pytest.mark.timeout(60)
def test_help_shows_the_defaults_and_the_refusals():
    r = glmrt_run("up", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "--port PORT TCP port of the API (0: any free port). (default: 30000)" in text
    assert "--tp-size TP_SIZE, --tp TP_SIZE, --tensor-parallel-size TP_SIZE tensor-parallel degree" in text
    assert "--enable-dp-attention refused: data-parallel attention is not built yet" in text
    assert "--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS Most tokens one forward computes" in text


@pytest.mark.timeout(60)
def test_a_token_budget_a_full_decode_batch_uses_up_is_one_line():
    line = one_line_refusal(glmrt_run("up", "--max-running-requests", "64", "--max-num-batched-tokens", "32"))
    assert line == ("glmrt up: error: --max-num-batched-tokens must be >= max_running_requests (64): a full decode "
                    "batch alone would use it up (got 32)")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "2", "--ep-size", "3"], "--ep-size 3 must be 1 or --tp-size (2)"),
    (["--ep-size", "2"], "--ep-size 2 must be 1 or --tp-size (1)"),
    (["--tp", "0"], "--tp-size must be >= 1 (got 0)"),
    (["--expert-parallel-size", "0"], "--ep-size must be >= 1 (got 0)"),
    (["--dp-size", "0"], "--dp-size must be >= 1 (got 0)"),
    (["--dp-size", "2", "--engine-replicas", "3"], "--dp-size 2 and --engine-replicas 3 disagree; give one"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-dp-attention"],
     "--enable-dp-attention: data-parallel attention is not built yet; an engine of --tp-size N splits attention "
     "heads over its N ranks, and --dp-size N runs N engine replicas"),
], ids=["ep-not-tp", "ep-without-tp", "tp-0", "ep-0", "dp-0", "dp-and-replicas", "dp-attention"])
def test_bad_parallel_sizes_are_one_line(flags, message):
    assert one_line_refusal(glmrt_run("up", *flags)) == f"glmrt up: error: {message}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--tp-size", "2"],
     "--nnodes 2 needs --dist-init-addr HOST:PORT (node 0's address, which every node reaches)"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--node-rank 2 is out of range for --nnodes 2 (0..1)"),
    (["--node-rank", "1"], "--node-rank 1 is out of range for --nnodes 1 (0..0)"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "0.0.0.0:5000"],
     "--dist-init-addr: '0.0.0.0:5000' names no host: give node 0's own address, which the other nodes connect "
     "to (the link binds only there)"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1"], "--dist-init-addr: '127.0.0.1' is not "
     "HOST:PORT"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "127.0.0.1:5000"],
     "--nnodes 2 must divide the engine's tp (3): each node runs tp / nnodes of its ranks"),
    (["--nnodes", "2", "--tp-size", "2", "--engine-replicas", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--nnodes 2: the engine runs one replica over the nodes (got replicas 2)"),
    (["--dist-init-addr", "127.0.0.1:5000"], "--dist-init-addr is for a deployment over several nodes; set "
     "--nnodes too, or leave it out"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:5000", "--curve-key-file", "/no/such"],
     "--curve-key-file: cannot read the CURVE key file /no/such: Invalid certificate file: /no/such"),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "192.0.2.1:5000"],
     "--dist-init-addr: 192.0.2.1 is not an address of this machine (Cannot assign requested address); node 0 runs "
     "rank 0, which listens there: give this node's own address"),
], ids=["no-addr", "rank-range", "rank-one-node", "wildcard", "no-port", "tp-split", "replicas", "addr-alone",
        "key-file", "not-mine"])
def test_bad_node_flags_are_one_line(flags, message):
    assert one_line_refusal(glmrt_run("up", *flags)) == f"glmrt up: error: {message}"


@pytest.mark.timeout(60)
def test_a_prefill_decode_pair_over_nodes_is_one_line(tmp_path):
    path = tmp_path / "pd.toml"
    path.write_text('[nodes]\nnnodes = 2\ndist_init_addr = "127.0.0.1:5000"\n[[actors]]\nkind = "tokenizer"\n'
                    '[[actors]]\nkind = "prefill"\n[[actors]]\nkind = "decode"\n[[actors]]\nkind = "detokenizer"\n')
    line = one_line_refusal(glmrt_run("up", str(path)))
    assert line == ("glmrt up: error: [nodes] nnodes 2: a deployment over several nodes runs one 'engine' entry "
                    "whose ranks are spread over the nodes; prefill/decode over nodes is not built"), line


@pytest.mark.timeout(60)
def test_a_prefill_and_decode_of_different_tp_sizes_are_one_line(tmp_path):
    path = tmp_path / "pd.toml"
    path.write_text('[[actors]]\nkind = "tokenizer"\n[[actors]]\nkind = "prefill"\n[[actors]]\nkind = "decode"\n'
                    'tp = 2\n[[actors]]\nkind = "detokenizer"\n')
    line = one_line_refusal(glmrt_run("up", str(path)))
    assert line.startswith("glmrt up: error: prefill tp = 1 and decode tp = 2 differ: "), line
    assert "resharding between tp sizes is not built" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, message", [
    (["--cache-memory-gb", "inf"], "--cache-memory-gb must be a finite number (got inf)"),
    (["--max-request-mb", "inf"], "--max-request-mb must be a finite number (got inf)"),
    (["--mamba-full-memory-ratio", "nan"], "--mamba-full-memory-ratio must be a finite number (got nan)"),
], ids=["cache-inf", "request-inf", "ratio-nan"])
def test_numbers_that_are_not_finite_are_one_line(flags, message):
    assert one_line_refusal(glmrt_run("up", *flags)) == f"glmrt up: error: {message}"


@pytest.mark.timeout(60)
def test_a_preset_is_refused_naming_the_checkpoint_to_write(tmp_path):
    path = tmp_path / "preset.toml"
    path.write_text('[model]\nload_format = "dummy"\npreset = "flash-4l"\n')
    line = one_line_refusal(glmrt_run("up", str(path)))
    assert line.startswith("glmrt up: error: [model] preset 'flash-4l': glmrt up serves a checkpoint directory; "
                           "write one with `glmrt make-checkpoint --preset flash-4l --no-weights --out DIR`"), line


@pytest.mark.timeout(60)
def test_version():
    r = glmrt_run("--version")
    assert r.returncode == 0 and r.stdout == f"glmrt {glmrt.__version__}\n", (r.stdout, r.stderr)


@pytest.mark.timeout(60)
def test_model_path_is_sglangs_spelling_of_model(tmp_path):
    line = one_line_refusal(glmrt_run("up", "--model-path", str(tmp_path)))
    assert line == f"glmrt up: error: no config.json in {tmp_path}"
