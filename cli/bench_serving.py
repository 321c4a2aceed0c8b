"""`glmrt bench serving`: an online benchmark of any OpenAI-compatible server, over HTTP.

Workloads (--dataset):
  random         N prompts of L random tokens each, O output tokens each.
  shared-prefix  as random, but the first R*L tokens (--shared-prefix-ratio R) are shared by
                 every prompt of a group (--num-groups G, prompt i is in group i % G).
  multi-turn     N conversations of K turns (--num-turns). Turn k's prompt is turn k-1's prompt,
                 turn k-1's answer and a new user message: an append-only prefix, as agentic
                 traces have. A conversation sends its turns one after the other; with R > 0 its
                 first R*L words are a system message shared by all conversations.

Prompts: on /v1/completions (--endpoint completions, the default for random and shared-prefix)
a prompt is a list of token ids drawn from [10, V-100) (--vocab-size V), so input lengths are
exact; on /v1/chat/completions (the default for multi-turn) it is text of L words from a fixed
word list (its token count is what the server reports). Each run of a sweep draws its own
prompts from (--seed, run index), the same shapes, so no run hits the prefix cache filled by the
runs before it.

Load: --request-rate Q spaces the arrivals (of requests; of conversations in multi-turn) as a
Poisson process seeded by --seed (inf: all at once); --max-concurrency C caps the requests in
flight (a comma list, 1,8,32,64, runs the workload once per value: a sweep).

Measures (per request, from the SSE stream): TTFT = the first chunk carrying output (a
non-empty token_ids, content, reasoning_content or text; not the role-only chunk), ITL = the
gaps between the next chunks carrying output (a chunk of k tokens counts k gaps of 1/k of it),
TPOT = (e2e - TTFT) / (output_tokens - 1), e2e = the whole request. Tokens are the server's:
usage (prompt, completion and cached tokens, `stream_options.include_usage`) and the per-chunk
`token_ids` (`return_token_ids`, sent in the body; ignored by servers without it); nothing is
re-tokenised. `ignore_eos` is sent unless --no-ignore-eos (random weights stop early).
Goodput: the completed requests with TTFT < --slo-ttft-ms and TPOT < --slo-tpot-ms, per second.

Output: a tqdm progress bar on stderr (--quiet: none), --out FILE (JSON: the configuration, and
per run a summary and every request), --plot FILE.png (latency percentiles and throughput
against concurrency; needs --max-concurrency), and a short summary table, printed last.
Exit status 0; 1 when the server cannot be reached or every request of a run failed; 2 on
usage errors. No torch here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from glmrt import env

DEFAULT_URL = "http://127.0.0.1:30000"
DATASETS = ("random", "shared-prefix", "multi-turn")
TOKEN_LOW = 10          # prompt ids come from [TOKEN_LOW, vocab_size - TOKEN_HEADROOM)
TOKEN_HEADROOM = 100
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")

# A fixed word list for chat prompts (the seed picks the words).
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population site river
""".split()


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "serving", help="an OpenAI-compatible server over HTTP: throughput, TTFT/TPOT/ITL, goodput",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--url", default=env.url(),
                   help=f"the server's base URL (default $GLMRT_URL or {DEFAULT_URL})")
    s.add_argument("--model", metavar="M", help="the model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", default=env.api_key(), help="default $GLMRT_API_KEY")
    s.add_argument("--endpoint", choices=["completions", "chat"],
                   help="completions: token-id prompts (default for random, shared-prefix); "
                        "chat: text prompts (default for multi-turn)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers without it, or real weights)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random")
    w.add_argument("--num-prompts", type=int, default=32, metavar="N",
                   help="requests (multi-turn: conversations, of --num-turns requests each)")
    w.add_argument("--input-len", type=int, default=256, metavar="L",
                   help="prompt tokens (chat: words); multi-turn: of the first turn's prompt")
    w.add_argument("--output-len", type=int, default=32, metavar="O", help="max_tokens of each request")
    w.add_argument("--shared-prefix-ratio", type=float, default=None, metavar="R",
                   help="the shared part of each prompt, in [0, 1) (shared-prefix default 0.5; else 0)")
    w.add_argument("--num-groups", type=int, default=1, metavar="G", help="shared-prefix groups")
    w.add_argument("--num-turns", type=int, default=3, metavar="K", help="multi-turn: turns per conversation")
    w.add_argument("--turn-len", type=int, metavar="T",
                   help="multi-turn: the new user message of each later turn, tokens or words (default L)")
    w.add_argument("--vocab-size", type=int, default=512, metavar="V",
                   help=f"token-id prompts use ids in [{TOKEN_LOW}, V-{TOKEN_HEADROOM}) (default 512)")
    w.add_argument("--seed", type=int, default=0)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", default="inf", metavar="Q",
                    help="arrivals per second, Poisson (multi-turn: conversations); inf: all at once")
    ld.add_argument("--max-concurrency", metavar="C",
                    help="requests in flight at most; a comma list (1,8,32) sweeps (default: no cap)")
    ld.add_argument("--slo-ttft-ms", type=float, default=6000.0, help="goodput SLO on TTFT (default 6000)")
    ld.add_argument("--slo-tpot-ms", type=float, default=25.0, help="goodput SLO on TPOT (default 25)")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="FILE", help="write the results (JSON) to FILE")
    o.add_argument("--plot", metavar="FILE", help="a PNG of latency percentiles and throughput vs concurrency")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


class _Usage(ValueError):
    pass


def _parse_rate(text: str) -> float:
    try:
        q = float(text)
    except ValueError:
        raise _Usage(f"--request-rate must be a number or inf, got {text!r}") from None
    if not q > 0:
        raise _Usage(f"--request-rate must be > 0, got {text!r}")
    return q


def _parse_concurrency(text: str | None) -> list[int | None]:
    if text is None:
        return [None]
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part.lower() in ("inf", "none", "0"):
            out.append(None)
            continue
        try:
            c = int(part)
        except ValueError:
            raise _Usage(f"--max-concurrency must be integers, comma-separated, got {text!r}") from None
        if c < 1:
            raise _Usage(f"--max-concurrency values must be >= 1, got {c}")
        out.append(c)
    if not out:
        raise _Usage("--max-concurrency is empty")
    return out


def _check_args(args) -> None:
    for flag in ("num_prompts", "input_len", "output_len", "num_groups", "num_turns"):
        if getattr(args, flag) < 1:
            raise _Usage(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.turn_len is not None and args.turn_len < 1:
        raise _Usage("--turn-len must be >= 1")
    if args.shared_prefix_ratio is None:
        args.shared_prefix_ratio = 0.5 if args.dataset == "shared-prefix" else 0.0
    if not 0 <= args.shared_prefix_ratio < 1:
        raise _Usage(f"--shared-prefix-ratio must be in [0, 1), got {args.shared_prefix_ratio}")
    if args.vocab_size < TOKEN_LOW + TOKEN_HEADROOM + 1:
        raise _Usage(f"--vocab-size must be > {TOKEN_LOW + TOKEN_HEADROOM}")
    if args.endpoint is None:
        args.endpoint = "chat" if args.dataset == "multi-turn" else "completions"
    if args.request_timeout <= 0:
        raise _Usage("--request-timeout must be > 0")
    args.rate = _parse_rate(args.request_rate)
    args.concurrencies = _parse_concurrency(args.max_concurrency)
    if args.plot and args.max_concurrency is None:
        raise _Usage("--plot draws against concurrency: give --max-concurrency (e.g. 1,8,32)")


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    """One unit of arrival: a single request (random, shared-prefix) or a conversation whose
    turns go one after the other. `messages[k]` is turn k's new user message (chat: text;
    completions: token ids); `system` is a shared system message (chat) or shared ids prefix."""

    index: int
    system: Any
    messages: list[Any]


def make_workload(args, run_index: int) -> list[Conversation]:
    g = random.Random(f"glmrt-bench-serving:{args.dataset}:{args.endpoint}:{args.seed}:{run_index}")
    chat = args.endpoint == "chat"
    hi = args.vocab_size - TOKEN_HEADROOM

    def piece(n: int) -> Any:
        if chat:
            return " ".join(g.choice(WORDS) for _ in range(n))
        return [g.randrange(TOKEN_LOW, hi) for _ in range(n)]

    L = args.input_len
    shared = int(round(args.shared_prefix_ratio * L))
    shared = min(shared, L - 1)                        # every prompt keeps a token of its own
    groups = [piece(shared) if shared else None for _ in range(args.num_groups)]
    out = []
    if args.dataset == "multi-turn":
        turn_len = args.turn_len or L
        for i in range(args.num_prompts):
            first = piece(L - shared)
            msgs = [first] + [piece(turn_len) for _ in range(args.num_turns - 1)]
            out.append(Conversation(i, groups[i % args.num_groups], msgs))
    else:
        for i in range(args.num_prompts):
            out.append(Conversation(i, groups[i % args.num_groups], [piece(L - shared)]))
    return out


# ---------------------------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    conversation: int
    turn: int
    ok: bool = False
    error: str | None = None
    start: float = 0.0                 # seconds since the run began
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0             # usage.completion_tokens (or the streamed ids / chunks)
    streamed_token_ids: int | None = None   # token ids seen in the stream (None: the server sends none)
    usage_reported: bool = False
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    # not in the JSON: what the next turn of the conversation appends
    answer_text: str = field(default="", repr=False)
    answer_reasoning: str = field(default="", repr=False)
    answer_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("answer_text")
        d.pop("answer_reasoning")
        d.pop("answer_ids")
        return d


def _error_message(raw: bytes | str, status: int | None = None) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    msg = text.strip()[:500]
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            msg = str(err.get("message") or err)[:500]
        elif isinstance(err, str):
            msg = err[:500]
    except ValueError:
        pass
    return f"HTTP {status}: {msg}" if status is not None else msg


async def _sse_events(resp):
    """The `data:` payloads of an SSE body (lines of any length: a first chunk may echo a long
    prompt's token ids)."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        scan = len(buf)
        buf += chunk
        begin = 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            line = bytes(buf[begin:nl]).rstrip(b"\r")
            begin = scan = nl + 1
            if line.startswith(b"data:"):
                yield line[5:].strip()
        del buf[:begin]
    rest = bytes(buf).strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


async def send_request(session, url: str, headers: dict, body: dict, res: Result, t_run: float,
                       timeout: float) -> Result:
    import aiohttp

    t0 = time.perf_counter()
    res.start = t0 - t_run
    last = None
    ids_mode = False
    n_ids = 0
    text_parts: list[str] = []
    reasoning_parts: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = _error_message(await resp.read(), resp.status)
                return res
            async for payload in _sse_events(resp):
                if payload == b"[DONE]":
                    break
                if not payload:
                    continue
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    res.error = f"bad SSE payload: {payload[:200]!r}"
                    return res
                if not isinstance(obj, dict):
                    continue
                if obj.get("error") is not None and not obj.get("choices"):
                    res.error = "stream error: " + _error_message(json.dumps(obj))
                    return res
                usage = obj.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                new = 0
                has_text = False
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    text = ch.get("text") or delta.get("content") or ""
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if text or reasoning or delta.get("tool_calls"):
                        has_text = True
                    if text:
                        text_parts.append(text)
                    if reasoning:
                        reasoning_parts.append(reasoning)
                    ids = ch.get("token_ids")
                    if ids is not None:
                        ids_mode = True
                        new += len(ids)
                        res.answer_ids.extend(ids)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if not ids_mode and has_text:
                    new = 1  # a server without token ids: one token per chunk carrying output
                if new:
                    n_ids += new
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itls.extend([(now - last) / new] * new)
                    last = now
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
        return res
    except (aiohttp.ClientError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.answer_text = "".join(text_parts)
    res.answer_reasoning = "".join(reasoning_parts)
    res.streamed_token_ids = n_ids if ids_mode else None
    if not res.usage_reported:
        res.output_tokens = n_ids
    if res.ttft is None:
        res.error = "the stream carried no output"
        return res
    if res.output_tokens > 1:
        res.tpot = (res.e2e - res.ttft) / (res.output_tokens - 1)
    res.ok = True
    return res


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------


class Client:
    def __init__(self, args, model: str):
        self.args = args
        self.model = model
        base = args.url.rstrip("/")
        self.url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, prompt: Any, max_tokens: int) -> dict:
        b: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.args.temperature,
                             "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if self.args.endpoint == "chat":
            b["messages"] = prompt
        else:
            b["prompt"] = prompt
        if self.args.ignore_eos:
            b["ignore_eos"] = True
        return b


async def _conversation(client: Client, session, conv: Conversation, sem, t_run: float, on_done,
                        inflight: dict) -> list[Result]:
    """The turns of one conversation, one after the other, holding a concurrency slot throughout
    (so concurrency counts requests in flight and conversations alike)."""
    args = client.args
    results: list[Result] = []
    chat = args.endpoint == "chat"
    history: list = ([{"role": "system", "content": conv.system}] if conv.system else []) if chat \
        else list(conv.system or [])
    async with sem if sem is not None else contextlib.nullcontext():
        for turn, msg in enumerate(conv.messages):
            if chat:
                history.append({"role": "user", "content": msg})
            else:
                history.extend(msg)
            prompt = list(history)
            res = Result(conv.index, turn)
            inflight["now"] += 1
            inflight["peak"] = max(inflight["peak"], inflight["now"])
            try:
                await send_request(session, client.url, client.headers, client.body(prompt, args.output_len), res,
                                   t_run, args.request_timeout)
            finally:
                inflight["now"] -= 1
            results.append(res)
            on_done(res)
            if not res.ok:  # the conversation cannot go on without this answer
                for k in range(turn + 1, len(conv.messages)):
                    skipped = Result(conv.index, k, error="skipped: an earlier turn failed", start=res.start)
                    results.append(skipped)
                    on_done(skipped)
                break
            if chat:
                answer = {"role": "assistant", "content": res.answer_text}
                if res.answer_reasoning:  # a thinking model's answer: its reasoning is part of it
                    answer["reasoning_content"] = res.answer_reasoning
                history.append(answer)
            else:
                history.extend(res.answer_ids)
    return results


async def run_once(client: Client, session, convs: list[Conversation], concurrency: int | None, rate: float,
                   seed: int, quiet: bool, label: str) -> tuple[list[Result], float, int]:
    """All conversations, arriving as a Poisson process of `rate` (inf: at once), at most
    `concurrency` in flight. Returns the results, the run's seconds and the peak in flight."""
    from tqdm import tqdm

    total = sum(len(c.messages) for c in convs)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    inflight = {"now": 0, "peak": 0}
    arrivals = random.Random(f"glmrt-bench-serving-arrivals:{seed}")
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=quiet, leave=False,
              dynamic_ncols=True) as bar:
        def on_done(res: Result) -> None:
            bar.update(1)

        t_run = time.perf_counter()
        tasks = []
        for i, conv in enumerate(convs):
            if i and math.isfinite(rate):
                await asyncio.sleep(arrivals.expovariate(rate))
            tasks.append(asyncio.create_task(_conversation(client, session, conv, sem, t_run, on_done, inflight)))
        per_conv = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_run
    results = sorted((r for rs in per_conv for r in rs), key=lambda r: (r.conversation, r.turn))
    return results, duration, inflight["peak"]


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


def percentile(sorted_xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), of a sorted list."""
    if not sorted_xs:
        return float("nan")
    k = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def stats_ms(xs: list[float]) -> dict:
    s = sorted(x * 1000.0 for x in xs)
    if not s:
        return {"count": 0, "mean": None, "min": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"count": len(s), "mean": sum(s) / len(s), "min": s[0], **{f"p{p}": percentile(s, p) for p in PERCENTILES},
            "max": s[-1]}


def summarize(results: list[Result], duration: float, *, concurrency: int | None, rate: float,
              peak_inflight: int, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r.ok]
    errs = [r for r in results if not r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft * 1000 < slo_ttft_ms and (r.tpot is None or r.tpot * 1000 < slo_tpot_ms)]
    messages: dict[str, int] = {}
    for r in errs:
        messages[r.error or "?"] = messages.get(r.error or "?", 0) + 1
    d = max(duration, 1e-9)
    return {
        "max_concurrency": concurrency, "request_rate": rate if math.isfinite(rate) else "inf",
        "requests": len(results), "completed": len(ok), "errors": len(errs),
        "error_messages": dict(sorted(messages.items(), key=lambda kv: -kv[1])[:10]),
        "duration_s": duration, "peak_inflight": peak_inflight,
        "total_input_tokens": prompt, "total_cached_tokens": cached,
        "cached_token_ratio": cached / prompt if prompt else 0.0, "total_output_tokens": output,
        "request_throughput": len(ok) / d, "input_throughput": prompt / d, "output_throughput": output / d,
        "total_token_throughput": (prompt + output) / d,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "good_requests": len(good), "goodput": len(good) / d,
        "goodput_ratio": len(good) / len(results) if results else 0.0,
    }


def _fmt_lat(st: dict) -> str:
    if not st["count"]:
        return "-"
    return "/".join(f"{st[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))


def format_summary(runs: list[dict], title: str) -> str:
    rows = [
        ("max concurrency", lambda s: "none" if s["max_concurrency"] is None else str(s["max_concurrency"])),
        ("requests ok / errors", lambda s: f"{s['completed']} / {s['errors']}"),
        ("duration (s)", lambda s: f"{s['duration_s']:.2f}"),
        ("request throughput (req/s)", lambda s: f"{s['request_throughput']:.2f}"),
        ("output throughput (tok/s)", lambda s: f"{s['output_throughput']:.1f}"),
        ("total throughput (tok/s)", lambda s: f"{s['total_token_throughput']:.1f}"),
        ("input / cached / output tok", lambda s: f"{s['total_input_tokens']} / {s['total_cached_tokens']} / "
                                                  f"{s['total_output_tokens']}"),
        ("cached-token ratio", lambda s: f"{100 * s['cached_token_ratio']:.1f}%"),
        ("TTFT ms mean/p50/p90/p99", lambda s: _fmt_lat(s["ttft_ms"])),
        ("TPOT ms mean/p50/p90/p99", lambda s: _fmt_lat(s["tpot_ms"])),
        ("ITL ms mean/p50/p90/p99", lambda s: _fmt_lat(s["itl_ms"])),
        ("E2E ms mean/p50/p90/p99", lambda s: _fmt_lat(s["e2e_ms"])),
        ("goodput (req/s, % of reqs)", lambda s: f"{s['goodput']:.2f} ({100 * s['goodput_ratio']:.0f}%)"),
    ]
    cells = [[name] + [f(r["summary"]) for r in runs] for name, f in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [title]
    for row in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for r in runs:
        for msg, n in r["summary"]["error_messages"].items():
            c = r["summary"]["max_concurrency"]
            lines.append(f"  error x{n} (max concurrency {c if c else 'none'}): {msg}")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(((r["summary"]["max_concurrency"], r["summary"]) for r in runs if r["summary"]["max_concurrency"]),
                 key=lambda x: x[0])
    xs = [c for c, _ in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            ys = [s[key][f"p{p}"] if s[key]["count"] else float("nan") for _, s in pts]
            ax.plot(xs, ys, style, label=f"p{p}")
        ax.set_ylabel(name)
        ax.legend()
    axes[2].plot(xs, [s["output_throughput"] for _, s in pts], "o-", label="output tok/s")
    axes[2].set_ylabel("output throughput (tok/s)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("max concurrency")
        if xs and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


async def _get_json(session, url: str, headers: dict) -> dict | None:
    import aiohttp
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def _main(args) -> int:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        models = await _get_json(session, base + "/v1/models", headers)
        model = args.model
        if model is None:
            if not models or not models.get("data"):
                print(f"glmrt bench serving: error: cannot list the models of {args.url} (/v1/models); "
                      f"is the server up? (or pass --model)", file=sys.stderr)
                return 1
            model = models["data"][0]["id"]
        info = await _get_json(session, base + "/server_info", headers)  # glmrt only
        client = Client(args, model)
        # one untimed request: fail fast on a wrong URL, model or key
        probe = [{"role": "user", "content": "hello"}] if args.endpoint == "chat" else [TOKEN_LOW + 1] * 4
        res = await send_request(session, client.url, client.headers, client.body(probe, 2), Result(-1, 0),
                                 time.perf_counter(), args.request_timeout)
        if not res.ok:
            print(f"glmrt bench serving: error: the test request to {client.url} failed: {res.error}", file=sys.stderr)
            return 1
        runs = []
        for i, c in enumerate(args.concurrencies):
            convs = make_workload(args, i)
            label = f"concurrency {c if c else 'none'}"
            results, duration, peak = await run_once(client, session, convs, c, args.rate, args.seed, args.quiet,
                                                     label)
            summary = summarize(results, duration, concurrency=c, rate=args.rate, peak_inflight=peak,
                                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
            runs.append({"summary": summary, "requests": [r.to_json() for r in results]})
    config = {k: getattr(args, k) for k in (
        "url", "endpoint", "dataset", "num_prompts", "input_len", "output_len", "shared_prefix_ratio", "num_groups",
        "num_turns", "turn_len", "vocab_size", "seed", "ignore_eos", "temperature", "slo_ttft_ms", "slo_tpot_ms")}
    config.update(model=model, request_rate=args.rate if math.isfinite(args.rate) else "inf",
                  max_concurrency=args.concurrencies)
    server = {"model": model, "max_model_len": (models or {}).get("data", [{}])[0].get("max_model_len")}
    if info:
        server["context_length"] = info.get("context_length")
        server["engines"] = {k: {f: v.get(f) for f in ("page_size", "backend", "dtype", "max_running_requests")}
                             for k, v in (info.get("engines") or {}).items() if isinstance(v, dict)}
    doc = {"config": config, "server": server, "runs": runs}
    shape = (f"{args.num_prompts} conversations x {args.num_turns} turns" if args.dataset == "multi-turn"
             else f"{args.num_prompts} requests")
    title = (f"glmrt bench serving: {args.dataset} on {model} ({args.endpoint}), {shape}, "
             f"input {args.input_len} {'words' if args.endpoint == 'chat' else 'tokens'}, output {args.output_len}"
             + (f", shared {args.shared_prefix_ratio:g}" if args.shared_prefix_ratio else "")
             + f", rate {args.request_rate}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(runs, args.plot, title.replace("glmrt bench serving: ", ""))
    print(format_summary(runs, title))
    return 1 if any(r["summary"]["completed"] == 0 for r in runs) else 0


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
    except _Usage as e:
        print(f"glmrt bench serving: error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_main(args))
