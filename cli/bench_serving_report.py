"""The numbers of `glmrt bench serving`: one run's summary (throughput, latency percentiles,
goodput), the table printed for a sweep, and its plot."""

from __future__ import annotations

import math

from cli.bench_serving_client import Result

PERCENTILES = (50, 90, 99)


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


def spec_counters(info: dict | None) -> dict[str, float]:
    """The speculative decoding counters of a /server_info answer, summed over its engines."""
    out: dict[str, float] = {}
    for eng in ((info or {}).get("engines") or {}).values():
        if isinstance(eng, dict):
            for k, v in eng.items():
                if k.startswith("spec_") and isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
    return out


def spec_summary(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """What the engines' speculation did during one run (None: no engine speculates): the mean
    tokens kept per drafting request and step (the accepted length), the acceptance rate at each
    draft position, and the mean draft and verify time per speculative step."""
    if "spec_cycles" not in after:
        return None
    d = {k: after[k] - before.get(k, 0) for k in after}
    cycles, steps = d["spec_cycles"], d["spec_steps"]
    rates = []
    i = 0
    while f"spec_drafted_at_{i}" in d:
        n = d[f"spec_drafted_at_{i}"]
        rates.append(d[f"spec_accepted_at_{i}"] / n if n else 0.0)
        i += 1
    return {"cycles": int(cycles), "mean_accepted_length": d["spec_emitted_tokens"] / cycles if cycles else 0.0,
            "acceptance_rate": rates, "draft_tokens": int(d["spec_draft_tokens"]),
            "accepted_tokens": int(d["spec_accepted_tokens"]),
            "draft_ms_per_step": 1000 * d["spec_draft_seconds"] / steps if steps else 0.0,
            "verify_ms_per_step": 1000 * d["spec_verify_seconds"] / steps if steps else 0.0}


def _fmt_spec(s: dict, key: str) -> str:
    sp = s.get("speculative")
    if not sp:
        return "-"
    if key == "rate":
        return "/".join(f"{100 * r:.0f}" for r in sp["acceptance_rate"]) or "-"
    if key == "time":
        return f"{sp['draft_ms_per_step']:.1f} / {sp['verify_ms_per_step']:.1f}"
    return f"{sp['mean_accepted_length']:.2f}"


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
    if any(r["summary"].get("speculative") for r in runs):
        rows += [("spec: mean accepted length", lambda s: _fmt_spec(s, "length")),
                 ("spec: acceptance % per position", lambda s: _fmt_spec(s, "rate")),
                 ("spec: draft / verify ms per step", lambda s: _fmt_spec(s, "time"))]
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
