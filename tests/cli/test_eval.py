"""`glmrt eval`: answer parsing, GSM8K files, and a run against a small OpenAI-style server."""

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from cli.main import main
from glmrt.train.arithmetic import extract_answer
from glmrt.train.corpus import held_out_problems


@pytest.mark.parametrize("text,want", [
    ("working\n#### 714", 714), ("#### 1,234", 1234), ("The answer is 42.", 42), ("the answer is -7", -7),
    ("3+4=7 then 7*2=14", 14), ("no digits here", None), ("", None), ("#### 5 and later 9", 5),
    ("answer is 12 but #### 13", 13),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_bad_files_and_flags_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final line"}\n')
    assert main(["eval", "--data", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    bad.write_text("not json\n")
    assert main(["eval", "--data", str(bad)]) == 2
    assert main(["eval", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["eval", "--num-shots", "2"]) == 2
    assert main(["eval", "--concurrency", "0"]) == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server():
    """Answers right for even-indexed held-out problems, wrongly for the odd, no number for every 5th.
    With `hold` set (requests in flight), each answer waits until that many are in flight (at most
    5 s); `peak` is the most that were."""
    answers = {q: p.answer for p, q in held_out_problems(0, 150)}
    order = [q for _, q in held_out_problems(0, 150)]
    seen = []
    flight = {"now": 0, "peak": 0, "hold": 0}

    async def chat(request):
        body = await request.json()
        q = body["messages"][-1]["content"]
        seen.append(body)
        flight["now"] += 1
        flight["peak"] = max(flight["peak"], flight["now"])
        for _ in range(500):
            if flight["peak"] >= flight["hold"]:
                break
            await asyncio.sleep(0.01)
        flight["now"] -= 1
        i = order.index(q)
        text = "no idea" if i % 5 == 4 else f"The answer is {answers[q] + (i % 2)}."
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}],
                                  "usage": {"completion_tokens": 7, "spec_verify_ct": 2}})

    async def models(request):
        return web.json_response({"data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    port = _free_port()
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", seen, flight
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_eval_scores_a_server(fake_server, tmp_path, capsys):
    url, seen, _ = fake_server
    out = tmp_path / "res.json"
    rc = main(["eval", "--url", url, "--num-questions", "20", "--concurrency", "4", "--quiet", "--no-thinking",
               "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    # right: even indices not ≡ 4 mod 5 -> 0,2,6,8,10,12,16,18 ; invalid: 4,9,14,19
    assert res["accuracy"] == pytest.approx(8 / 20)
    assert res["invalid"] == pytest.approx(4 / 20)
    assert res["accept_length"] == pytest.approx(3.5)
    assert res["output_tokens"] == 140
    assert all(b["chat_template_kwargs"] == {"thinking": False} and b["model"] == "tiny" for b in seen)
    table = capsys.readouterr().out
    assert "accuracy" in table and "0.400" in table


def test_eval_few_shot_from_a_file(fake_server, tmp_path):
    url, seen, _ = fake_server
    data = tmp_path / "d.jsonl"
    probs = held_out_problems(0, 20)
    data.write_text("".join(json.dumps({"question": q, "answer": f"w\n#### {p.answer}"}) + "\n" for p, q in probs))
    out = tmp_path / "res.json"
    assert main(["eval", "--url", url, "--data", str(data), "--num-shots", "2", "--num-questions", "3",
                 "--quiet", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["questions"] == 3
    first = seen[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant", "user"]
    assert first[1]["content"].endswith(f"#### {probs[0][0].answer}")


def test_eval_keeps_as_many_requests_in_flight_as_asked(fake_server, tmp_path):
    """--concurrency past the HTTP client's default pool of 100 connections is what the server sees."""
    url, _, flight = fake_server
    flight["hold"] = 150
    out = tmp_path / "res.json"
    assert main(["eval", "--url", url, "--num-questions", "150", "--concurrency", "150", "--quiet",
                 "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["questions"] == 150
    assert flight["peak"] == 150
