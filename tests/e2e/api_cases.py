"""What the OpenAI-surface e2e modules share: the deployment fixtures (default topology, one
actor each, `--context-length 1024` and the module's own DEPLOY_FLAGS; each module starts its
own), prompts and helpers."""

from __future__ import annotations

import json
import time

import pytest

CONTEXT = 1024
USER = [{"role": "user", "content": "Tell me about the weather in Paris."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]



@pytest.fixture(scope="module")
def dep(request, start_deployment):
    flags = list(getattr(request.module, "DEPLOY_FLAGS", []))
    d = start_deployment(["--context-length", str(CONTEXT), *flags], name="api-basic")
    yield d
    d.stop(term_wait=5)


@pytest.fixture(scope="module")
def client(dep):
    c = dep.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(dep):
    return dep.model_id()


def extra_field(obj, name):
    """A field the openai types do not declare (reasoning_content, token_ids, ...)."""
    v = getattr(obj, name, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(name)
    return v


def error_json(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    return err


def log_lines(dep, needle: str) -> list[str]:
    """The lines of the deployment's output that contain `needle`."""
    return [line for line in dep.output().splitlines() if needle in line]


def wait_for_log_lines(dep, needle: str, n: int = 1, timeout: float = 5.0) -> list[str]:
    """The lines containing `needle` once there are at least `n` of them (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while len(lines := log_lines(dep, needle)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return lines
