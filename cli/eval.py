"""`glmrt eval`: accuracy of a running server on GSM8K-format problems, through its OpenAI API.

Zero-shot chat on the held-out synthetic problems by default (the problems `glmrt train` never
trains on, generated from --seed), or any GSM8K-format JSONL file (`--data`: one object per line
with "question" and "answer" ending in "#### N"), optionally with --num-shots worked examples
(the file's first K records, as earlier turns of the chat). A reply is right when its final
answer (glmrt.train.arithmetic.extract_answer: "#### N", "The answer is N", else its last
number) equals the label; a reply with no number is invalid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from glmrt import env


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="accuracy of a running server on GSM8K-format problems (OpenAI API)",
        description="Send GSM8K-format problems to a running server as chats and score the final answers: "
                    "accuracy, invalid-answer rate, output throughput and, when the server reports it, the "
                    "mean accepted length of speculative decoding. One table, and JSON with --output-json.")
    p.add_argument("--url", default=env.url(), help="the server's base URL (default $GLMRT_URL or the local one)")
    p.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=env.api_key(), help="default $GLMRT_API_KEY")
    p.add_argument("--data", metavar="FILE", help="GSM8K-format JSONL (default: the held-out synthetic problems)")
    p.add_argument("--num-shots", type=int, default=0, metavar="K",
                   help="worked examples before each question (the first K records of --data)")
    p.add_argument("--num-questions", type=int, default=500, metavar="N", help="problems to score")
    p.add_argument("--seed", type=int, default=0, help="the synthetic held-out set's seed (without --data)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-thinking", action="store_true", help="thinking off (chat_template_kwargs.thinking=false)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--output-json", metavar="FILE", help="write the results (JSON) to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _refuse(msg: str) -> int:
    print(f"glmrt eval: error: {msg}", file=sys.stderr)
    return 2


def load_gsm8k(path: str) -> list[dict]:
    """Records of a GSM8K-format JSONL file, each with its integer `label`; ValueError names the line."""
    from glmrt.train.arithmetic import extract_answer

    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("question"), str) \
                    or not isinstance(rec.get("answer"), str):
                raise ValueError(f"{path}:{n}: each line must be an object with string \"question\" and \"answer\"")
            if "####" not in rec["answer"]:
                raise ValueError(f"{path}:{n}: the answer has no \"#### N\" final line")
            label = extract_answer(rec["answer"])
            if label is None:
                raise ValueError(f"{path}:{n}: the answer's \"#### N\" is not an integer")
            records.append({"question": rec["question"], "answer": rec["answer"], "label": label})
    return records


def build_messages(question: str, shots: list[dict]) -> list[dict]:
    messages = []
    for s in shots:
        messages += [{"role": "user", "content": s["question"]}, {"role": "assistant", "content": s["answer"]}]
    return messages + [{"role": "user", "content": question}]


def score(reply: str | None, label: int) -> tuple[bool, bool]:
    """-> (right, invalid) for one reply."""
    from glmrt.train.arithmetic import extract_answer

    got = extract_answer(reply or "")
    return got == label, got is None


def summarise(rows: list[dict], wall: float) -> dict:
    n = len(rows)
    ok = [r for r in rows if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    res = {"questions": n, "accuracy": sum(r["right"] for r in rows) / n if n else 0.0,
           "invalid": sum(r["invalid"] for r in rows) / n if n else 0.0,
           "errors": n - len(ok), "output_tokens": out_tokens, "seconds": wall,
           "output_throughput": out_tokens / wall if wall > 0 else 0.0}
    verify = sum(r["verify_steps"] or 0 for r in ok)
    if verify and all(r["verify_steps"] for r in ok):
        res["accept_length"] = out_tokens / verify
    return res


def format_table(res: dict) -> str:
    lines = [("questions", f"{res['questions']}"), ("accuracy", f"{res['accuracy']:.3f}"),
             ("invalid", f"{res['invalid']:.3f}"), ("errors", f"{res['errors']}"),
             ("output tokens", f"{res['output_tokens']}"), ("seconds", f"{res['seconds']:.1f}"),
             ("output tok/s", f"{res['output_throughput']:.1f}")]
    if "accept_length" in res:
        lines.append(("accept length", f"{res['accept_length']:.2f}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v:>10}" for k, v in lines)


async def _first_model(session, url: str, headers: dict) -> str:
    async with session.get(f"{url}/v1/models", headers=headers) as resp:
        body = await resp.json(content_type=None)
        if resp.status != 200 or not body.get("data"):
            raise RuntimeError(f"GET /v1/models answered {resp.status}: {str(body)[:200]}")
        return body["data"][0]["id"]


async def _ask(session, url, headers, body, item, timeout) -> dict:
    import aiohttp

    row = {"index": item["index"], "label": item["label"], "right": False, "invalid": True, "error": None,
           "output_tokens": 0, "verify_steps": None, "reply": None}
    try:
        async with session.post(f"{url}/v1/chat/completions", headers=headers, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                row["error"] = f"HTTP {resp.status}: {str(data.get('error', data))[:300]}"
                return row
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
        return row
    msg = data["choices"][0]["message"]
    usage = data.get("usage") or {}
    row["reply"] = msg.get("content")
    row["output_tokens"] = int(usage.get("completion_tokens") or 0)
    row["verify_steps"] = usage.get("spec_verify_ct")
    row["right"], row["invalid"] = score(row["reply"], item["label"])
    return row


async def evaluate(args, items: list[dict]) -> tuple[list[dict], float]:
    import aiohttp

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=len(items), desc="eval", unit="q", dynamic_ncols=True)
    sem = asyncio.Semaphore(args.concurrency)
    right = 0
    # no connection cap of the client's own (its default is 100): the semaphore sets the requests in flight
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await _first_model(session, url, headers)

        async def one(item):
            nonlocal right
            body = {"model": model, "messages": item["messages"], "max_tokens": args.max_tokens,
                    "temperature": args.temperature}
            if args.no_thinking:
                body["chat_template_kwargs"] = {"thinking": False}
            async with sem:
                row = await _ask(session, url, headers, body, item, args.request_timeout)
            right += row["right"]
            if bar is not None:
                bar.update(1)
                bar.set_postfix(acc=f"{right / bar.n:.3f}", refresh=False)
            return row

        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(it) for it in items))
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(rows), wall


def run(args: argparse.Namespace) -> int:
    if args.num_questions < 1:
        return _refuse(f"--num-questions must be at least 1, got {args.num_questions}")
    if args.num_shots < 0:
        return _refuse(f"--num-shots must not be negative, got {args.num_shots}")
    if args.concurrency < 1:
        return _refuse(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.max_tokens < 1:
        return _refuse(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.data is None:
        if args.num_shots:
            return _refuse("--num-shots needs --data (the held-out set is zero-shot)")
        from glmrt.train.corpus import held_out_gsm8k
        from glmrt.train.arithmetic import extract_answer
        records = [{**r, "label": extract_answer(r["answer"])} for r in held_out_gsm8k(args.seed, args.num_questions)]
    else:
        try:
            records = load_gsm8k(args.data)
        except OSError as e:
            return _refuse(f"--data {args.data}: {e.strerror or e}")
        except ValueError as e:
            return _refuse(str(e))
        if len(records) <= args.num_shots:
            return _refuse(f"--data has {len(records)} records: none is left after {args.num_shots} shots")
    shots, pool = records[: args.num_shots], records[args.num_shots:]
    pool = pool[: args.num_questions]
    items = [{"index": i, "label": r["label"], "messages": build_messages(r["question"], shots)}
             for i, r in enumerate(pool)]
    try:
        rows, wall = asyncio.run(evaluate(args, items))
    except (OSError, RuntimeError) as e:
        return _refuse(f"cannot evaluate against {args.url}: {e}")
    res = summarise(rows, wall)
    print(format_table(res))
    errors = [r["error"] for r in rows if r["error"]]
    if errors:
        print(f"{len(errors)} request(s) failed; first: {errors[0]}", file=sys.stderr)
    if args.output_json:
        data = {**res, "data": args.data or f"held-out synthetic (seed {args.seed})", "num_shots": args.num_shots,
                "thinking": not args.no_thinking, "rows": rows}
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    return 0 if not errors else 1
