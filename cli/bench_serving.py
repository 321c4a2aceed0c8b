"""`glmrt bench serving`: an online benchmark of any OpenAI-compatible server, over HTTP.

Workloads (--dataset):
  random         N prompts of L random tokens each, O output tokens each.
  shared-prefix  as random, but the first R*L tokens (--shared-prefix-ratio R) are shared by
                 every prompt of a group (--num-groups G, prompt i is in group i % G).
  multi-turn     N conversations of K turns (--num-turns). Turn k's prompt is turn k-1's prompt,
                 turn k-1's answer and a new user message: an append-only prefix, as agentic
                 traces have. A conversation sends its turns one after the other; with R > 0 its
                 first R*L words are a system message shared by all conversations.
  chats          N chats from the synthetic training corpus (glmrt/train/corpus.py) that the
                 trained tiny model never trained on: mostly arithmetic problems of the held-out
                 split (the ones `glmrt eval` asks first), some tool-call and JSON chats. Each is
                 sent as messages (and tools) on /v1/chat/completions, thinking on, so the
                 server's chat template renders it as training did; --seed picks them. The
                 answers end by themselves: ignore_eos is not sent and --output-len O is only
                 the max_tokens cap, so output lengths vary. The workload for speculative
                 decoding's acceptance on text the model knows (--input-len, --num-turns,
                 --turn-len, --num-groups, --shared-prefix-ratio and --vocab-size do not apply).

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
re-tokenised. `ignore_eos` is sent unless --no-ignore-eos or --dataset chats (random weights stop early).
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
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from cli.bench_serving_client import Result, send_request
from cli.bench_serving_report import format_summary, plot, spec_counters, spec_summary, summarize
from glmrt import env

DEFAULT_URL = "http://127.0.0.1:30000"
DATASETS = ("random", "shared-prefix", "multi-turn", "chats")
# the workload flags that chats (a fixed corpus) has no use for, and their defaults elsewhere
SHAPE_DEFAULTS = {"input_len": 256, "num_groups": 1, "num_turns": 3, "turn_len": None, "vocab_size": 512,
                  "shared_prefix_ratio": None}
TOKEN_LOW = 10          # prompt ids come from [TOKEN_LOW, vocab_size - TOKEN_HEADROOM)
TOKEN_HEADROOM = 100
SPEC_STATS_WAIT_S = 1.2  # > the engines' stats period (actors/engine.py: STATS_S)

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
                        "chat: text prompts (default for multi-turn; the only one for chats)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers without it, or real weights); "
                        "chats never sends it")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random")
    w.add_argument("--num-prompts", type=int, default=32, metavar="N",
                   help="requests (multi-turn: conversations, of --num-turns requests each)")
    w.add_argument("--input-len", type=int, default=None, metavar="L",
                   help="prompt tokens (chat: words); multi-turn: of the first turn's prompt (default 256)")
    w.add_argument("--output-len", type=int, default=32, metavar="O",
                   help="max_tokens of each request (chats: a cap, the answers stop by themselves)")
    w.add_argument("--shared-prefix-ratio", type=float, default=None, metavar="R",
                   help="the shared part of each prompt, in [0, 1) (shared-prefix default 0.5; else 0)")
    w.add_argument("--num-groups", type=int, default=None, metavar="G", help="shared-prefix groups (default 1)")
    w.add_argument("--num-turns", type=int, default=None, metavar="K",
                   help="multi-turn: turns per conversation (default 3)")
    w.add_argument("--turn-len", type=int, metavar="T",
                   help="multi-turn: the new user message of each later turn, tokens or words (default L)")
    w.add_argument("--vocab-size", type=int, default=None, metavar="V",
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
    if args.dataset == "chats":
        given = [f for f in SHAPE_DEFAULTS if getattr(args, f) is not None]
        if given:
            raise _Usage(f"--{given[0].replace('_', '-')} does not apply to --dataset chats (its chats are fixed)")
        if args.endpoint == "completions":
            raise _Usage("--dataset chats sends messages: it needs --endpoint chat")
        args.ignore_eos = False  # the trained model's answers end by themselves
    for flag, default in SHAPE_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
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
        args.endpoint = "chat" if args.dataset in ("multi-turn", "chats") else "completions"
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
    completions: token ids; chats: the whole request, {"messages", "tools"}); `system` is a
    shared system message (chat) or shared ids prefix."""

    index: int
    system: Any
    messages: list[Any]


def make_workload(args, run_index: int) -> list[Conversation]:
    if args.dataset == "chats":
        from glmrt.train.corpus import held_out_chats

        # run k of a sweep takes the k-th slice of the list, so no run hits an earlier run's cache
        n = args.num_prompts
        chats = held_out_chats(args.seed, n * (run_index + 1))[n * run_index:]
        return [Conversation(i, None, [{"messages": c.messages[:-1], "tools": c.tools}])
                for i, c in enumerate(chats)]
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
# one run
# ---------------------------------------------------------------------------------------------


class Client:
    def __init__(self, args, model: str):
        self.args = args
        self.model = model
        base = args.url.rstrip("/")
        self.url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, prompt: Any, max_tokens: int, tools: list | None = None) -> dict:
        b: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.args.temperature,
                             "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        if self.args.endpoint == "chat":
            b["messages"] = prompt
            if tools:
                b["tools"] = tools
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
            tools = None
            if args.dataset == "chats":
                history, tools = list(msg["messages"]), msg["tools"]
            elif chat:
                history.append({"role": "user", "content": msg})
            else:
                history.extend(msg)
            prompt = list(history)
            res = Result(conv.index, turn)
            inflight["now"] += 1
            inflight["peak"] = max(inflight["peak"], inflight["now"])
            try:
                await send_request(session, client.url, client.headers, client.body(prompt, args.output_len, tools),
                                   res, t_run, args.request_timeout)
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
            spec_before = spec_counters(await _get_json(session, base + "/server_info", headers) if info else None)
            results, duration, peak = await run_once(client, session, convs, c, args.rate, args.seed, args.quiet,
                                                     label)
            summary = summarize(results, duration, concurrency=c, rate=args.rate, peak_inflight=peak,
                                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
            if "spec_cycles" in spec_before:
                await asyncio.sleep(SPEC_STATS_WAIT_S)  # the engines' counters reach the api once a second
                spec = spec_summary(spec_before, spec_counters(await _get_json(session, base + "/server_info",
                                                                                headers)))
                if spec is not None:
                    summary["speculative"] = spec
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
    lengths = (f"output up to {args.output_len}" if args.dataset == "chats" else
               f"input {args.input_len} {'words' if args.endpoint == 'chat' else 'tokens'}, output {args.output_len}")
    title = (f"glmrt bench serving: {args.dataset} on {model} ({args.endpoint}), {shape}, {lengths}"
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
