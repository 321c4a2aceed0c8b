"""E2E: `glmrt up` refuses a bad engine or log value, given as a flag or in a topology file, in one
line on stderr with exit status 2, before it starts anything (it prints nothing on stdout: the
"serving" line comes before the first actor is spawned), in seconds."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.e2e.conftest import REPO, free_port, glmrt_cmd

# The refusal imports no torch and starts no actor (both checked apart: stdout empty, and
# test_a_refusal_imports_no_torch_and_no_actor); it takes ~1 s alone, and 5.0-5.2 s was seen on a
# loaded 2-core machine, so the bound only tells a refusal from a start that waits for readiness.
QUICK_S = 20.0

# flag, bad value, the requirement the refusal must state
BAD_VALUES = [
    ("schedule-policy", "random", "must be one of fcfs, lpm"),
    ("chunked-prefill-size", "0", "must be >= 1"),
    ("mamba-full-memory-ratio", "-0.5", "must be > 0"),
    ("max-running-requests", "0", "must be >= 1"),
    ("context-length", "0", "must be >= 1"),
    ("cuda-graph-max-bs", "0", "must be >= 1"),
    ("state-checkpoint-interval", "-8", "must be >= 0"),
    ("log-level", "loud", "must be one of debug, info, warning, error"),
    ("log-interval", "-0.5", "must be >= 0"),
]
ACTORS = '[[actors]]\nkind = "tokenizer"\n[[actors]]\nkind = "engine"\n[[actors]]\nkind = "detokenizer"\n'


def _refused(args: list[str], env) -> tuple[str, str]:
    t0 = time.monotonic()
    port = [] if "--port" in args else ["--port", str(free_port())]
    r = subprocess.run(glmrt_cmd() + ["up", *args, *port, "--ready-timeout", "30"],
                       cwd=str(REPO), env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    assert r.returncode == 2, f"status {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert took < QUICK_S, f"took {took:.1f} s"
    assert r.stdout == "", f"something started: {r.stdout}"
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("glmrt up: error: "), r.stderr
    return lines[0], r.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, value, requirement", BAD_VALUES, ids=[f"{f}={v}" for f, v, _ in BAD_VALUES])
def test_bad_flag_is_refused_in_one_line(tmp_path, e2e_env, tiny_checkpoint, flag, value, requirement):
    line, _ = _refused(["--model", tiny_checkpoint, f"--{flag}", value], e2e_env)
    assert line == f"glmrt up: error: --{flag} {requirement} (got {_shown(value)})"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, value, requirement", BAD_VALUES, ids=[f"{f}={v}" for f, v, _ in BAD_VALUES])
def test_bad_topology_value_is_refused_in_one_line(tmp_path, e2e_env, tiny_checkpoint, flag, value, requirement):
    key = flag.replace("-", "_")
    toml_value = f'"{value}"' if not value.lstrip("-").replace(".", "").isdigit() else value
    path = tmp_path / "topology.toml"
    section = "log" if flag.startswith("log-") else "engine"
    path.write_text(f"[{section}]\n{key} = {toml_value}\n" + ACTORS)
    line, _ = _refused([str(path), "--model", tiny_checkpoint], e2e_env)
    assert line == f"glmrt up: error: [{section}] {key} {requirement} (got {_shown(value)})"


def _shown(value: str):
    """The value as the refusal prints it (the parsed int, float or string)."""
    for kind in (int, float):
        try:
            return repr(kind(value))
        except ValueError:
            pass
    return repr(value)


@pytest.mark.timeout(60)
def test_a_refusal_imports_no_torch_and_no_actor(e2e_env):
    import sys

    probe = ("import sys\nfrom cli.main import main\nrc = main(['up', '--cuda-graph-max-bs', '0'])\n"
             "print(rc, sorted(m for m in ('torch', 'actors.supervisor', 'actors.engine', 'actors.api') "
             "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=str(REPO), env=e2e_env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split("\n")[0] == "2 []", (r.stdout, r.stderr)
    assert r.stderr == "glmrt up: error: --cuda-graph-max-bs must be >= 1 (got 0)\n"


@pytest.mark.timeout(60)
def test_host_tier_flags_are_refused_before_anything_starts(e2e_env, tiny_checkpoint):
    from glmrt.devices import mem_available_bytes

    line, _ = _refused(["--model", tiny_checkpoint, "--hicache-size", "4"], e2e_env)
    assert line == ("glmrt up: error: --hicache-size is set only with the host tier on (enable_hierarchical_cache, "
                    "--enable-hierarchical-cache) (got 4.0)")
    huge = 3 * mem_available_bytes() / 1e9
    line, _ = _refused(["--model", tiny_checkpoint, "--enable-hierarchical-cache", "--hicache-size", str(huge)],
                       e2e_env)
    assert line.startswith("glmrt up: error: --hicache-size / --hicache-ratio: the host tiers need ")
    assert "GiB of host memory (engine 1 x " in line and line.endswith(" GiB is available")
    # each rank holds a tier of its own: one that fits once does not fit twice
    most = 0.7 * mem_available_bytes() / 1e9
    line, _ = _refused(["--model", tiny_checkpoint, "--enable-hierarchical-cache", "--hicache-size", str(most),
                        "--tp-size", "2"], e2e_env)
    assert "GiB of host memory (engine 1 x 2 ranks x " in line and line.endswith(" GiB is available")


@pytest.mark.timeout(60)
def test_a_port_in_use_is_refused_in_one_line(e2e_env, tiny_checkpoint):
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(glmrt_cmd() + ["up", "--model", tiny_checkpoint, "--port", str(port)], cwd=str(REPO),
                           env=e2e_env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "", f"something started: {r.stdout}"   # no "serving", no "draining and stopping"
    assert r.stderr == (f"glmrt up: error: port {port} on 127.0.0.1 is in use (another glmrt or server listens "
                        "there); stop it or pick --port\n")


@pytest.mark.timeout(60)
def test_gpus_on_a_machine_without_gpu_are_refused(tmp_path, e2e_env, tiny_checkpoint):
    from glmrt.devices import gpu_count

    if gpu_count():
        pytest.skip("this machine has GPUs")
    path = tmp_path / "topology.toml"
    path.write_text(ACTORS.replace('kind = "engine"\n', 'kind = "engine"\ngpus = [0]\n'))
    line, _ = _refused([str(path), "--model", tiny_checkpoint], e2e_env)
    assert line == ("glmrt up: error: engine: gpus = [0], but this machine has no GPU; leave gpus out to run it on "
                    "the CPU")


@pytest.mark.timeout(60)
def test_the_readme_topology_works_as_written(tmp_path, e2e_env, tiny_checkpoint):
    """The README's example, `~` in its [model] path included, is read and its checkpoint found: the run
    gets as far as the checkpoint's own checks (here an explicit --quantization it refuses)."""
    import os
    import re

    readme = (REPO / "README.md").read_text()
    example = re.search(r"A topology file[^\n]*\n\n```toml\n(.*?)```", readme, re.S).group(1)
    assert 'path = "~/ckpt/tiny"' in example
    home = tmp_path / "home"
    (home / "ckpt").mkdir(parents=True)
    os.symlink(tiny_checkpoint, home / "ckpt" / "tiny")
    path = tmp_path / "topology.toml"
    path.write_text(example)
    line, _ = _refused([str(path), "--port", str(free_port()), "--quantization", "fp8"], {**e2e_env, "HOME": str(home)})
    assert "the checkpoint's weights are bf16" in line, line



# speculative decoding flags, as SGLang's recipes spell them: the one-line refusal's text after "error: "
SPEC_REFUSALS = [
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"],
     "--speculative-eagle-topk is refused: tree drafting is not supported (use 1: a chain) (got 2)"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-draft-tokens must be speculative_num_steps + 1 = 6 with a chain (topk 1) (got 8)"),
    (["--speculative-algorithm", "DFLASH2"],
     "--speculative-algorithm is refused: DFlash2 drafting is not built (EAGLE drafts with the checkpoint's MTP "
     "layer) (got 'DFLASH2')"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm must be one of none, EAGLE, NEXTN, MTP "
                                            "(got 'MEDUSA')"),
    (["--speculative-num-steps", "3"],
     "--speculative-num-steps is set only with speculative_algorithm EAGLE (--speculative-algorithm) (got 3)"),
    (["--speculative-algorithm", "MTP", "--speculative-num-steps", "0"], "--speculative-num-steps must be >= 1 and "
                                                                          "< 17 (got 0)"),
]


@pytest.mark.timeout(120)
def test_speculative_flags_are_refused_in_one_line(tmp_path, e2e_env, tiny_checkpoint):
    """SGLang's MTP flags: what is not built (trees, DFlash2, a draft-token count off the chain) is refused in
    one line before anything starts, as a flag and as an [engine] key; so are a prefill and a decode that
    do not both speculate, and a checkpoint without an MTP layer."""
    import json

    for args, text in SPEC_REFUSALS:
        line, _ = _refused(["--model", tiny_checkpoint, *args], e2e_env)
        assert line == f"glmrt up: error: {text}", line
    path = tmp_path / "topology.toml"
    path.write_text('[engine]\nspeculative_algorithm = "EAGLE"\nspeculative_eagle_topk = 4\n' + ACTORS)
    line, _ = _refused([str(path), "--model", tiny_checkpoint], e2e_env)
    assert line == ("glmrt up: error: [engine] speculative_eagle_topk is refused: tree drafting is not supported "
                    "(use 1: a chain) (got 4)"), line
    path.write_text(ACTORS.replace('kind = "engine"\n', 'kind = "prefill"\n[[actors]]\nkind = "decode"\n'
                                   'engine = { speculative_algorithm = "EAGLE" }\n'))
    line, _ = _refused([str(path), "--model", tiny_checkpoint], e2e_env)
    assert line == ("glmrt up: error: prefill and decode must agree on speculative_algorithm: prefill 'none', "
                    "decode 'EAGLE' (their state could not be handed over)"), line
    no_mtp = tmp_path / "no-mtp"
    no_mtp.mkdir()
    cfg = json.loads((__import__("pathlib").Path(tiny_checkpoint) / "config.json").read_text())
    cfg["text_config"]["num_nextn_predict_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(cfg))
    line, _ = _refused(["--model", str(no_mtp), "--speculative-algorithm", "EAGLE"], e2e_env)
    assert line == ("glmrt up: error: engine: --speculative-algorithm EAGLE needs the checkpoint's MTP layer, and "
                    "this checkpoint has none (num_nextn_predict_layers 0 in config.json)"), line
