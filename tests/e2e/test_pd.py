"""E2E: prefill/decode disaggregation by placement alone — a topology with `prefill` and
`decode` actors instead of `engine`. The prefill computes the prompt and the first token,
hands the named state components to the decode, which continues: the same greedy tokens as one
unified engine. A pair with incompatible layouts is refused at start when the configs show it,
and at run time (each request, by name, never a hang) when only the loaded models do."""

from __future__ import annotations

import random

import openai
import pytest

pytestmark = pytest.mark.slow

PD = """
[engine]
page_size = 16
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "prefill"
[[actors]]
kind = "decode"
{decode_engine}
[[actors]]
kind = "detokenizer"
"""


def topology(tmp_path, name: str, decode_engine: str = "") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(PD.format(decode_engine=decode_engine))
    return str(path)


@pytest.fixture(scope="module")
def dep(start_deployment, tmp_path_factory):
    d = start_deployment([topology(tmp_path_factory.mktemp("pd"), "pd")], name="pd")
    yield d
    d.stop(term_wait=5)


def prompts():
    rng = random.Random(7)
    system = [rng.randrange(10, 900) for _ in range(40)]
    return [system + [rng.randrange(10, 900) for _ in range(5 + i)] for i in range(3)]


@pytest.fixture(scope="module")
def unified_tokens(tiny_checkpoint):
    import torch
    torch.set_num_threads(1)
    from glmrt.engine.config import EngineConfig
    from glmrt.engine.engine import Engine
    from glmrt.sampling_params import SamplingParams
    e = Engine(EngineConfig(model=tiny_checkpoint, page_size=16, disable_radix_cache=True), log=lambda *a: None)
    outs = e.generate(prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [c[0].output_ids for c in outs]


@pytest.mark.timeout(180)
def test_pd_serves_the_same_greedy_tokens_as_unified(dep, unified_tokens):
    client = dep.client()
    got = []
    for p in prompts():
        r = client.completions.create(model=dep.model_id(), prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        got.append(r.choices[0].model_extra["token_ids"])
    assert got == unified_tokens
    streamed = [c.choices[0].model_extra["token_ids"] for c in client.completions.create(
        model=dep.model_id(), prompt=prompts()[0], max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True}) if c.choices]
    assert sum(streamed, []) == unified_tokens[0]
    assert {a["kind"] for a in dep.actors()} == {"tokenizer", "prefill", "decode", "detokenizer"}


@pytest.mark.timeout(180)
def test_pd_structured_output(dep):
    """The prefill samples the first token under the grammar, the decode replays it through its
    own matcher and goes on: each of n choices ends valid, thinking on (with a budget) and off."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                               "tag": {"type": "string", "maxLength": 4}},
              "required": ["ok", "n", "tag"], "additionalProperties": False}
    client = dep.client(timeout=120.0)
    for extra in ({"chat_template_kwargs": {"thinking": False}}, {"max_thinking_tokens": 3}):
        r = client.chat.completions.create(
            model=dep.model_id(), messages=[{"role": "user", "content": "JSON"}], n=4, temperature=1.0, top_p=1.0,
            max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            extra_body=extra)
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), schema)


@pytest.mark.timeout(180)
def test_pd_prefix_cache_and_scaling_decode(dep, unified_tokens):
    client = dep.client()
    p = prompts()[2]
    r = client.completions.create(model=dep.model_id(), prompt=p, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.choices[0].model_extra["token_ids"] == unified_tokens[2]
    assert dep.cli("scale", "decode=2").returncode == 0
    for _ in range(60):
        if len([a for a in dep.actors("decode") if a["state"] == "ready"]) == 2:
            break
        import time
        time.sleep(1)
    for q in prompts():
        r = client.completions.create(model=dep.model_id(), prompt=q, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    assert dep.cli("scale", "decode=1").returncode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override, field", [("engine = { page_size = 32 }", "page_size"),
                                             ('engine = { dtype = "bfloat16" }', "dtype"),
                                             ('engine = { mamba_ssm_dtype = "bfloat16" }', "mamba_ssm_dtype")])
def test_incompatible_pair_is_refused_at_start(tmp_path, tiny_checkpoint, e2e_env, override, field):
    import subprocess
    from tests.e2e.conftest import glmrt_cmd
    path = topology(tmp_path, "bad", decode_engine=override)
    r = subprocess.run(glmrt_cmd() + ["up", path, "--model", tiny_checkpoint, "--port", "1"], env=e2e_env,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and field in r.stderr and "decode" in r.stderr



@pytest.mark.timeout(240)
def test_decode_restarted_on_another_layout_is_refused_at_run_time(start_deployment, tmp_path, tiny_checkpoint):
    """The configs agree, so `glmrt up` starts the pair. A decode restarted on the same model
    serves again (the prefill reconnects to its new transfer engine); one restarted on a model
    whose cache layout differs (its checkpoint changed under the same path) gets every request
    refused by name (503, the differing field), none hangs, and the prefill holds none of them."""
    import json
    import os
    import shutil
    import signal
    import time

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model, ignore=shutil.ignore_patterns("*.safetensors*"))
    d = start_deployment([topology(tmp_path, "relayout"), "--model", str(model), "--load-format", "dummy"],
                         name="pd-relayout")
    try:
        client = d.client()

        def restart_decode():
            old_pid = d.actors("decode")[0]["pid"]
            os.kill(old_pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not any(a["state"] == "ready" and a["pid"] != old_pid for a in d.actors("decode")):
                assert time.monotonic() < deadline, f"decode did not restart: {d.actors()}"
                time.sleep(0.5)

        def served() -> int:
            return client.completions.create(model=d.model_id(), prompt=prompts()[0], max_tokens=2, temperature=0,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens

        assert served() == 2
        restart_decode()
        assert served() == 2  # a decode restarted on the same model
        config = json.loads((model / "config.json").read_text())
        config["text_config"]["kv_lora_rank"] //= 2
        (model / "config.json").write_text(json.dumps(config))
        restart_decode()
        for p in prompts():
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=d.model_id(), prompt=p, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert time.monotonic() - t0 < 20
            assert refused.value.status_code == 503
            message = str(refused.value)
            assert "incompatible prefill/decode pair" in message and "kv_lora_rank" in message, message
        time.sleep(1.5)  # engine stats are periodic
        prefill = d.get_json("/server_info")["engines"]["prefill/0"]
        assert prefill["handoff_bytes_sent"] > 0 and prefill["handoff_transfers"] == 2  # only the first two moved
        assert prefill["running"] == prefill["waiting"] == 0
    finally:
        d.stop(term_wait=5)


EPD = """
[engine]
page_size = 16
chunked_prefill_size = 32
[[actors]]
kind = "tokenizer"
[[actors]]
kind = "vision"
[[actors]]
kind = "prefill"
[[actors]]
kind = "decode"
[[actors]]
kind = "detokenizer"
"""


@pytest.mark.timeout(240)
def test_epd_equals_unified_for_text_and_image(start_deployment, tmp_path_factory, tiny_checkpoint):
    """E+P+D by placement: long prompts (> chunk size), prefix hits and an image prompt give
    the same greedy tokens as a unified engine computing everything itself."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    image_msg = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}]}]
    rng = random.Random(11)
    system = [rng.randrange(10, 900) for _ in range(70)]
    texts = [system + [rng.randrange(10, 900) for _ in range(n)] for n in (3, 30, 45)]
    path = tmp_path_factory.mktemp("epd") / "epd.toml"
    path.write_text(EPD)
    results = {}
    for name, args in (("unified", ["--page-size", "16", "--chunked-prefill-size", "32", "--disable-radix-cache"]),
                       ("epd", [str(path)])):
        d = start_deployment(args, name=name)
        try:
            c = d.client()
            out = []
            for p in texts:
                r = c.completions.create(model=d.model_id(), prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
                out.append((r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens))
            r = c.chat.completions.create(model=d.model_id(), messages=image_msg, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            out.append((r.choices[0].model_extra["token_ids"], 0))
            results[name] = out
        finally:
            d.stop(term_wait=5)
    assert [t for t, _ in results["epd"]] == [t for t, _ in results["unified"]]
    assert any(cached > 0 for _, cached in results["epd"][1:3])  # the shared system prompt was hit


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["zmq", "nixl"])
def test_both_state_transports_serve_the_same_tokens(start_deployment, tmp_path_factory, e2e_env, unified_tokens,
                                                     transport):
    """The state moves through NIXL (one-sided writes into the decode's pools) or, where NIXL
    does not work, through the zmq fallback (the same calls and messages, the bytes as zmq
    frames into the same pools): the same tokens either way, bytes counted."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu13")
    e2e_env["GLMRT_KV_TRANSFER"] = transport
    try:
        d = start_deployment([topology(tmp_path_factory.mktemp(f"pd-{transport}"), transport)], name=f"pd-{transport}")
    finally:
        del e2e_env["GLMRT_KV_TRANSFER"]
    try:
        got = [d.client().completions.create(model=d.model_id(), prompt=p, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True}
                                             ).choices[0].model_extra["token_ids"] for p in prompts()]
        assert got == unified_tokens
        import time
        time.sleep(1.5)  # engine stats are periodic
        engines = d.get_json("/server_info")["engines"]
        assert {e["kv_transfer"] for e in engines.values()} == {transport}
        assert engines["prefill/0"]["handoff_bytes_sent"] == engines["decode/0"]["handoff_bytes_received"] > 0
    finally:
        d.stop(term_wait=5)
