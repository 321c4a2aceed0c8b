"""`glmrt compute-mamba-ratio` (in process) and `glmrt bench offline` (the console script)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from cli.main import main  # noqa: E402
from glmrt.checkpoint.presets import preset_config  # noqa: E402
from glmrt.engine.memory import balanced_ratio, plan_memory  # noqa: E402

GLMRT = shutil.which("glmrt", path=str(Path(sys.executable).parent)) or shutil.which("glmrt")
GIB = 2**30


def ratio_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run `glmrt compute-mamba-ratio ARGV` in process -> (exit code, stdout, stderr)."""
    try:
        rc = main(["compute-mamba-ratio", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def ratio_json(capsys, *argv: str) -> dict:
    rc, out, err = ratio_cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# ---- compute-mamba-ratio: explicit numbers ----------------------------------------------------
def test_ratio_from_explicit_numbers_hand_computed(capsys):
    # 400 B/token, 20,000 B/slot, mean 100 tokens:  r = 20000 / (100 * 400) = 0.5
    # pools: 10,000 tokens = 4.0e6 B, 500 slots = 1.0e7 B  -> budget 1.4e7 B, current r = 2.5
    # pin: floor(1.4e7 * (0.5 / 1.5) / 20000) = floor(233.33) = 233
    # now: KV serves 10000 / 100 = 100 requests, the state 500 -> KV is the bottleneck by 5x
    args = ("--mean-request-len", "100", "--kv-pool-tokens", "10000", "--state-pool-slots", "500",
            "--kv-bytes-per-token", "400", "--state-bytes-per-slot", "20000")
    o = ratio_json(capsys, *args)
    assert o["balanced_ratio"] == pytest.approx(0.5)
    assert o["current_ratio"] == pytest.approx(2.5)
    assert o["budget_bytes"] == pytest.approx(1.4e7)
    assert o["max_mamba_cache_size"] == 233
    assert o["balanced_kv_pool_tokens"] == (14_000_000 - 233 * 20000) // 400  # 23,350 ~ 233 slots x 100
    assert o["bottleneck"] == "kv" and o["bottleneck_factor"] == pytest.approx(5.0)
    assert o["kv_capacity_requests"] == pytest.approx(100) and o["state_capacity_requests"] == 500

    rc, text, _ = ratio_cli(capsys, *args)
    assert rc == 0
    assert "balanced --mamba-full-memory-ratio 0.5000" in text
    assert "current  --mamba-full-memory-ratio 2.5000" in text
    assert "--max-mamba-cache-size 233" in text
    assert "bottleneck now: the KV pool" in text and "5.00x" in text


def test_ratio_state_bottleneck_and_bytes_inputs(capsys):
    # same costs, pools given in bytes: 1 MB of KV = 2,500 tokens = 25 requests; 100 kB = 5 slots
    o = ratio_json(capsys, "--mean-request-len", "100", "--kv-pool-bytes", "1MB", "--state-pool-bytes", "100000",
                   "--kv-bytes-per-token", "400", "--state-bytes-per-slot", "20000")
    assert o["kv_pool_tokens"] == 2500 and o["state_pool_slots"] == 5
    assert o["bottleneck"] == "state" and o["bottleneck_factor"] == pytest.approx(5.0)
    assert o["current_ratio"] == pytest.approx(0.1)
    # bytes and sizes on both sides and no model: the costs are estimated from them
    o = ratio_json(capsys, "--mean-request-len", "50", "--kv-pool-bytes", "8KiB", "--kv-pool-tokens", "64",
                   "--state-pool-bytes", "3000", "--state-pool-slots", "3")
    assert o["kv_bytes_per_token"] == 128 and o["state_bytes_per_slot"] == 1000
    assert o["balanced_ratio"] == pytest.approx(1000 / (50 * 128)) and not o["exact_byte_costs"]


def test_ratio_from_preset_alone_matches_the_layout(capsys):
    from glmrt.cache.layout import CacheLayout
    lay = CacheLayout.from_config(preset_config("tiny").text, page_size=64, kv_dtype="bfloat16",
                                  state_dtype="float32", model_dtype="bfloat16")
    o = ratio_json(capsys, "--preset", "tiny", "--mean-request-len", "1000")
    assert o["kv_bytes_per_token"] == lay.kv_bytes_per_token and o["state_bytes_per_slot"] == lay.state_bytes_per_slot
    assert o["balanced_ratio"] == pytest.approx(balanced_ratio(lay, 1000))
    assert "current_ratio" not in o and "max_mamba_cache_size" not in o
    o = ratio_json(capsys, "--preset", "tiny", "--mean-request-len", "1000", "--budget-bytes", "1GiB")
    assert o["max_mamba_cache_size"] == plan_memory(lay, GIB, ratio=o["balanced_ratio"]).num_slots
    # the dtype flags change the per-slot bytes (bf16 recurrent state halves it)
    o16 = ratio_json(capsys, "--preset", "tiny", "--mean-request-len", "1000", "--mamba-ssm-dtype", "bfloat16")
    assert o16["state_bytes_per_slot"] == lay.state_bytes_per_slot - lay.recurrent_bytes_per_slot // 2
    o8 = ratio_json(capsys, "--preset", "tiny", "--mean-request-len", "1000", "--kv-cache-dtype", "fp8_e4m3")
    assert o8["kv_bytes_per_token"] < lay.kv_bytes_per_token


# ---- compute-mamba-ratio: a real engine's boot log --------------------------------------------
@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    """A tiny checkpoint, one real Engine on it, and its boot lines in a file."""
    from glmrt.checkpoint.writer import write_checkpoint
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine

    root = tmp_path_factory.mktemp("boot")
    ckpt = root / "tiny"
    write_checkpoint(preset_config("tiny"), str(ckpt), seed=0, dtype="float32", progress=False)
    lines: list[str] = []
    engine = Engine(EngineConfig(model=str(ckpt), page_size=8, cache_memory_gb=0.05, device="cpu"),
                    log=lines.append)
    log = root / "boot.log"
    log.write_text("\n".join(f"2026-01-01 00:00:00 INFO {line}" for text in lines for line in text.splitlines())
                   + "\n")
    return {"ckpt": str(ckpt), "engine": engine, "log": str(log), "text": log.read_text()}


def test_ratio_from_boot_log_with_model_is_exact(capsys, booted):
    e, mean = booted["engine"], 200
    assert "KV pool:" in booted["text"] and "state pool:" in booted["text"]
    o = ratio_json(capsys, "--boot-log", booted["log"], "--model", booted["ckpt"], "--mean-request-len", str(mean))
    plan = e.memory
    assert o["exact_byte_costs"]
    assert o["kv_bytes_per_token"] == e.layout.kv_bytes_per_token
    assert o["state_bytes_per_slot"] == e.layout.state_bytes_per_slot
    assert o["kv_pool_tokens"] == plan.kv_tokens and o["state_pool_slots"] == plan.num_slots
    assert o["kv_pool_bytes"] == plan.kv_bytes and o["state_pool_bytes"] == plan.state_bytes
    assert o["current_ratio"] == pytest.approx(plan.state_bytes / plan.kv_bytes)
    r = o["balanced_ratio"]
    assert r == pytest.approx(balanced_ratio(e.layout, mean))
    assert r == pytest.approx(e.layout.state_bytes_per_slot / (mean * e.layout.kv_bytes_per_token))
    # the pin and the ratio give the engine the same split of the same budget
    budget = plan.kv_bytes + plan.state_bytes
    pin = o["max_mamba_cache_size"]
    assert pin == math.floor(budget * r / (1 + r) / e.layout.state_bytes_per_slot)
    by_ratio = plan_memory(e.layout, budget, ratio=r)
    by_pin = plan_memory(e.layout, budget, max_mamba_cache_size=pin)
    assert by_ratio.num_slots == by_pin.num_slots == pin
    # balanced: the KV pool holds about slots x mean_len tokens
    assert by_ratio.kv_tokens == pytest.approx(pin * mean, rel=0.01)
    # now: 0.9 gives far more slots than the KV pool can feed at 200 tokens a request
    assert o["bottleneck"] == "kv"
    assert o["bottleneck_factor"] == pytest.approx(plan.num_slots / (plan.kv_tokens / mean))


def test_ratio_from_boot_log_alone_estimates_and_text(capsys, booted):
    e = booted["engine"]
    o = ratio_json(capsys, "--boot-log", booted["log"], "--mean-request-len", "200")
    assert not o["exact_byte_costs"]
    assert o["kv_pool_tokens"] == e.memory.kv_tokens and o["state_pool_slots"] == e.memory.num_slots
    # the log's GiB figures are rounded to 1 MiB: a few percent on this 0.05 GiB budget
    assert o["kv_bytes_per_token"] == pytest.approx(e.layout.kv_bytes_per_token, rel=0.03)
    assert o["state_bytes_per_slot"] == pytest.approx(e.layout.state_bytes_per_slot, rel=0.03)
    assert o["balanced_ratio"] == pytest.approx(balanced_ratio(e.layout, 200), rel=0.06)
    rc, text, _ = ratio_cli(capsys, "--boot-log", booted["log"], "--preset", "tiny", "--mean-request-len", "200")
    assert rc == 0
    assert f"{e.memory.kv_tokens:,} tokens" in text and f"{e.memory.num_slots:,} slots" in text
    for key in ("balanced --mamba-full-memory-ratio", "current  --mamba-full-memory-ratio",
                "equivalent --max-mamba-cache-size", "bottleneck now: the KV pool"):
        assert key in text


def test_ratio_help_names_the_formula(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compute-mamba-ratio", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "r = state_bytes_per_slot / (mean_len x kv_bytes_per_token)" in out
    assert "--max-mamba-cache-size = floor(B x r / (1 + r) / state_bytes_per_slot)" in out


# ---- compute-mamba-ratio: errors --------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--kv-pool-tokens", "10", "--state-pool-slots", "2", "--preset", "tiny"], "--mean-request-len"),
    (["--mean-request-len", "0", "--preset", "tiny"], "--mean-request-len"),
    (["--mean-request-len", "-5", "--preset", "tiny"], "--mean-request-len"),
    (["--mean-request-len", "nan", "--preset", "tiny"], "--mean-request-len"),
    (["--mean-request-len", "abc", "--preset", "tiny"], "--mean-request-len"),
    (["--mean-request-len", "100"], "--boot-log"),
    (["--mean-request-len", "100", "--kv-pool-tokens", "1000", "--state-pool-slots", "5"], "--preset"),
    (["--mean-request-len", "100", "--kv-pool-tokens", "1000", "--preset", "tiny"], "--state-pool-slots"),
    (["--mean-request-len", "100", "--state-pool-bytes", "1GiB", "--preset", "tiny"], "--kv-pool-tokens"),
    (["--mean-request-len", "100", "--kv-pool-tokens", "0", "--state-pool-slots", "5", "--preset", "tiny"],
     "--kv-pool-tokens"),
    (["--mean-request-len", "100", "--kv-pool-bytes", "-1", "--state-pool-slots", "5", "--preset", "tiny"],
     "--kv-pool-bytes"),
    (["--mean-request-len", "100", "--kv-pool-bytes", "12 parsecs", "--state-pool-slots", "5", "--preset", "tiny"],
     "--kv-pool-bytes"),
    (["--mean-request-len", "100", "--kv-bytes-per-token", "400"], "--state-bytes-per-slot"),
    (["--mean-request-len", "100", "--kv-bytes-per-token", "0", "--state-bytes-per-slot", "9"],
     "--kv-bytes-per-token"),
    (["--mean-request-len", "100", "--preset", "nope"], "--preset"),
    (["--mean-request-len", "100", "--preset", "tiny", "--page-size", "6"], "--page-size"),
    (["--mean-request-len", "100", "--boot-log", "/nonexistent/boot.log"], "--boot-log"),
])
def test_ratio_errors_exit_2_naming_the_flag(capsys, argv, flag):
    rc, out, err = ratio_cli(capsys, *argv)
    assert rc == 2, out
    assert flag in err, err
    assert out == ""


def test_ratio_boot_log_errors(capsys, tmp_path, booted):
    empty = tmp_path / "empty.log"
    empty.write_text("starting up\nserver ready\n")
    rc, _, err = ratio_cli(capsys, "--boot-log", str(empty), "--mean-request-len", "100")
    assert rc == 2 and "--boot-log" in err and "KV pool" in err and "state pool" in err
    half = tmp_path / "half.log"
    half.write_text("\n".join(line for line in booted["text"].splitlines() if "state pool" not in line))
    rc, _, err = ratio_cli(capsys, "--boot-log", str(half), "--mean-request-len", "100")
    assert rc == 2 and "state pool" in err and "no 'KV pool" not in err
    rc, _, err = ratio_cli(capsys, "--boot-log", booted["log"], "--mean-request-len", "100",
                           "--kv-pool-tokens", "100")
    assert rc == 2 and "--boot-log" in err and "--kv-pool-tokens" in err
    # the log's pools do not fit this model at these dtypes (bf16 state is half the size)
    rc, _, err = ratio_cli(capsys, "--boot-log", booted["log"], "--mean-request-len", "100", "--preset", "tiny",
                           "--mamba-ssm-dtype", "bfloat16")
    assert rc == 2 and "--boot-log" in err and "--mamba-ssm-dtype" in err


# ---- bench offline ----------------------------------------------------------------------------
def test_bench_group_needs_a_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2
    assert main(["bench", "offline", "--num-prompts", "4"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["bench", "offline", "--preset", "tiny"]) == 2
    assert "--load-format dummy" in capsys.readouterr().err
    assert main(["bench", "offline", "--preset", "tiny", "--load-format", "dummy", "--num-prompts", "0"]) == 2
    assert "--num-prompts" in capsys.readouterr().err


def test_bench_offline_tiny_prefix_cache_end_to_end(tmp_path):
    if GLMRT is None:
        pytest.skip("the glmrt console script is not installed")
    out_json = tmp_path / "bench.json"
    cmd = [GLMRT, "bench", "offline", "--preset", "tiny", "--load-format", "dummy", "--num-prompts", "6",
           "--shared-prefix-len", "48", "--suffix-len", "8", "--output-len", "4", "--page-size", "8",
           "--cache-memory-gb", "0.02", "--cpu-threads", "1", "--device", "cpu", "--json", str(out_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    # the table comes last: header, the two runs, the speed-up
    header, on, off, speed = lines[-4:]
    assert header.split()[:2] == ["run", "requests"] and "cached tok" in header and "total tok/s" in header
    on_f, off_f = on.split(), off.split()
    assert on_f[0] == "radix-on" and off_f[0] == "radix-off"
    requests, prompt_toks, cached, output = (int(x) for x in on_f[1:5])
    assert (requests, prompt_toks, output) == (6, 6 * (48 + 8), 6 * 4)
    assert cached > 0 and int(off_f[3]) == 0
    assert cached == 6 * 48  # every prompt resumes at the warm-up's checkpoint at the prefix end
    assert speed.startswith("speed-up (radix on / off):") and speed.endswith("x")
    assert "greedy outputs: identical for all 6 requests" in p.stdout
    doc = json.loads(out_json.read_text())
    assert doc["outputs_identical"] and doc["mismatches"] == []
    r_on, r_off = doc["runs"]
    assert r_on["cached_tokens"] == cached and r_off["cached_tokens"] == 0
    assert r_on["output_tokens"] == r_off["output_tokens"] == 24
    assert doc["speedup"] == pytest.approx(r_off["seconds"] / r_on["seconds"])
    for r in (r_on, r_off):
        assert r["total_tok_per_s"] == pytest.approx((r["prompt_tokens"] + r["output_tokens"]) / r["seconds"])
