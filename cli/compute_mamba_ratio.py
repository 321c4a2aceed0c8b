"""`glmrt compute-mamba-ratio`: the balanced --mamba-full-memory-ratio for a mean request length.

No torch: sizes come from CacheLayout (a preset or a checkpoint's config.json), from explicit
per-token / per-slot byte costs, or from the pool lines of one engine boot log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

GIB = 2**30

FORMULA = """\
The engine carves one cache budget into a paged KV pool (DSA layers) and a state pool of
request slots (KDA conv + recurrent state, indexer tail). --mamba-full-memory-ratio r is
state : KV bytes, so the state pool gets r / (1 + r) of the budget.

Balanced: the KV pool holds exactly slots x mean_len tokens, i.e.

    r = state_bytes_per_slot / (mean_len x kv_bytes_per_token)

For the same total budget B = KV pool bytes + state pool bytes, the equivalent pin is

    --max-mamba-cache-size = floor(B x r / (1 + r) / state_bytes_per_slot)

Now: the state pool serves `slots` requests and the KV pool kv_tokens / mean_len requests of
mean length; the smaller is the bottleneck. (A running request also holds one checkpoint slot
for the prefix cache, so the engine clamps max_running_requests to slots / 2.)

Inputs: --mean-request-len, and the two pools from --boot-log FILE (the engine's
"KV pool: ... tokens" and "state pool: ... slots" lines) or --kv-pool-tokens/--kv-pool-bytes
with --state-pool-slots/--state-pool-bytes. Per-token and per-slot bytes come from --preset or
--model (with --dtype / --kv-cache-dtype / --mamba-ssm-dtype / --page-size; a boot log supplies
its own dtypes and page size), from --kv-bytes-per-token/--state-bytes-per-slot, or, lacking
those, are estimated from pool bytes / pool size. With --preset/--model and no pools it prints
the balanced ratio (and the pin for --budget-bytes).
"""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_KV_LINE = re.compile(r"KV pool:\s*([0-9.]+)\s*GiB,\s*(\d+)\s*pages\s*x\s*(\d+)\s*=\s*(\d+)\s*tokens")
_STATE_LINE = re.compile(r"state pool:\s*([0-9.]+)\s*GiB,\s*(\d+)\s*slots")
_DTYPE_LINE = re.compile(r"glmrt engine:.*dtype (\w+), KV (\w+), state (\w+)")
_RUNNING_LINE = re.compile(r"max_running_requests:\s*(\d+)(?:\s*\(clamped:\s*(.*)\))?")


class UsageError(ValueError):
    """Bad or missing input; exit 2 with the message."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compute-mamba-ratio", help="the balanced --mamba-full-memory-ratio for a mean request length",
        description=FORMULA, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mean-request-len", type=float, metavar="TOKENS",
                   help="average tokens a request holds (prompt + output); required")
    g = p.add_argument_group("pools now (a boot log, or two explicit sizes)")
    g.add_argument("--boot-log", metavar="FILE", help="an engine boot log with the 'KV pool:' and 'state pool:' lines")
    g.add_argument("--kv-pool-tokens", type=int, metavar="N", help="KV pool size in tokens")
    g.add_argument("--kv-pool-bytes", metavar="B", help="KV pool size in bytes (suffixes: KiB MiB GiB, KB MB GB)")
    g.add_argument("--state-pool-slots", type=int, metavar="S", help="state pool size in slots")
    g.add_argument("--state-pool-bytes", metavar="B", help="state pool size in bytes (suffixes as above)")
    g.add_argument("--budget-bytes", metavar="B",
                   help="total cache budget, when no pools are given: prints the --max-mamba-cache-size pin")
    m = p.add_argument_group("per-token / per-slot bytes")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a named shape: tiny | flash-4l | flash")
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (its config.json)")
    m.add_argument("--kv-bytes-per-token", type=float, metavar="X", help="KV bytes per token (instead of a model)")
    m.add_argument("--state-bytes-per-slot", type=float, metavar="X", help="state bytes per slot (instead of a model)")
    m.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (conv state, and the KV dtype under 'auto'); default bfloat16 "
                        "(a GPU engine; CPU engines run float32), or the boot log's")
    m.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float16", "float32", "fp8_e4m3"],
                   help="default auto (= --dtype), or the boot log's")
    m.add_argument("--mamba-ssm-dtype", choices=["float32", "bfloat16"], help="default float32, or the boot log's")
    m.add_argument("--page-size", type=int, help="default 64, or the boot log's")
    p.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    p.set_defaults(func=run)


# ---- inputs ---------------------------------------------------------------------------------
def parse_bytes(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    mt = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not mt or mt.group(2).lower() not in _UNITS:
        raise UsageError(f"{flag}: cannot read {text!r} as bytes (a number, optionally with KiB/MiB/GiB or KB/MB/GB)")
    value = float(mt.group(1)) * _UNITS[mt.group(2).lower()]
    if value <= 0:
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return value


def parse_boot_log(path: str) -> dict:
    """The last engine boot block of a log: pool bytes (GiB rounded to 1 MiB), tokens, slots, dtypes."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"--boot-log: cannot read {path}: {e.strerror or e}") from e
    kv = _KV_LINE.findall(text)
    st = _STATE_LINE.findall(text)
    missing = [what for what, found in (("'KV pool: X GiB, N pages x P = T tokens'", kv),
                                        ("'state pool: Y GiB, S slots'", st)) if not found]
    if missing:
        raise UsageError(f"--boot-log {path}: no {' and no '.join(missing)} line (is this an engine boot log?)")
    kv_gib, pages, page_size, tokens = kv[-1]
    st_gib, slots = st[-1]
    out = {"kv_gib": float(kv_gib), "pages": int(pages), "page_size": int(page_size), "kv_tokens": int(tokens),
           "state_gib": float(st_gib), "slots": int(slots), "engines": max(len(kv), len(st))}
    if out["kv_tokens"] < 1 or out["slots"] < 1:
        raise UsageError(f"--boot-log {path}: the pools in the log are empty ({tokens} tokens, {slots} slots)")
    d = _DTYPE_LINE.findall(text)
    if d:
        out["dtype"], out["kv_dtype"], out["state_dtype"] = d[-1]
    r = _RUNNING_LINE.findall(text)
    if r:
        out["max_running_requests"] = int(r[-1][0])
        out["clamp"] = r[-1][1] or None
    return out


def _layout(args, boot: dict | None):
    """CacheLayout of --preset/--model with the dtypes and page size (flags > boot log > defaults)."""
    from glmrt.cache.layout import CacheLayout
    from glmrt.config import ConfigError, load_model_config

    if args.preset:
        from glmrt.checkpoint.presets import preset_config
        try:
            config = preset_config(args.preset)
        except ValueError as e:
            raise UsageError(f"--preset: {e}") from e
        name = f"preset {args.preset}"
    else:
        path = os.path.expanduser(args.model)
        try:
            config = load_model_config(path)
        except ConfigError as e:
            raise UsageError(f"--model: {e}") from e
        name = f"model {args.model}"
    boot = boot or {}
    dtype = args.dtype or boot.get("dtype") or "bfloat16"
    kv_dtype = args.kv_cache_dtype or boot.get("kv_dtype") or "auto"
    kv_dtype = dtype if kv_dtype == "auto" else kv_dtype
    state_dtype = args.mamba_ssm_dtype or boot.get("state_dtype") or "float32"
    page_size = args.page_size or boot.get("page_size") or 64
    if boot.get("page_size") and args.page_size and args.page_size != boot["page_size"]:
        raise UsageError(f"--page-size {args.page_size} contradicts the boot log's page size {boot['page_size']}")
    try:
        layout = CacheLayout.from_config(config.text, page_size=page_size, kv_dtype=kv_dtype,
                                         state_dtype=state_dtype, model_dtype=dtype)
    except (ValueError, KeyError) as e:
        raise UsageError(f"--page-size: {e}") from e
    return layout, f"{name}, page {page_size}, KV {kv_dtype}, state {state_dtype}, conv {dtype}"


def _positive(value, flag):
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{flag} must be positive, got {value}")
    return value


def compute(args) -> dict:
    """All the numbers, or UsageError."""
    mean = args.mean_request_len
    if mean is None:
        raise UsageError("--mean-request-len TOKENS is required (the average tokens a request holds)")
    _positive(mean, "--mean-request-len")
    for flag, v in (("--kv-pool-tokens", args.kv_pool_tokens), ("--state-pool-slots", args.state_pool_slots),
                    ("--kv-bytes-per-token", args.kv_bytes_per_token),
                    ("--state-bytes-per-slot", args.state_bytes_per_slot), ("--page-size", args.page_size)):
        _positive(v, flag)
    kv_bytes = parse_bytes(args.kv_pool_bytes, "--kv-pool-bytes")
    state_bytes = parse_bytes(args.state_pool_bytes, "--state-pool-bytes")
    budget_only = parse_bytes(args.budget_bytes, "--budget-bytes")
    kv_tokens, slots = args.kv_pool_tokens, args.state_pool_slots
    explicit = [f for f, v in (("--kv-pool-tokens", kv_tokens), ("--kv-pool-bytes", kv_bytes),
                               ("--state-pool-slots", slots), ("--state-pool-bytes", state_bytes)) if v is not None]
    model_given = bool(args.preset or args.model)
    costs_given = [f for f, v in (("--kv-bytes-per-token", args.kv_bytes_per_token),
                                  ("--state-bytes-per-slot", args.state_bytes_per_slot)) if v is not None]
    if model_given and costs_given:
        raise UsageError(f"{costs_given[0]} and --preset/--model both give the byte costs: use one")
    if len(costs_given) == 1:
        other = "--state-bytes-per-slot" if costs_given[0] == "--kv-bytes-per-token" else "--kv-bytes-per-token"
        raise UsageError(f"{costs_given[0]} needs {other} too")

    boot = None
    source = "explicit sizes"
    if args.boot_log:
        if explicit:
            raise UsageError(f"--boot-log and {explicit[0]} both give the pool sizes: use one")
        boot = parse_boot_log(args.boot_log)
        source = f"boot log {args.boot_log}"
        kv_tokens, slots = boot["kv_tokens"], boot["slots"]
        kv_bytes, state_bytes = boot["kv_gib"] * GIB, boot["state_gib"] * GIB

    if boot is None and explicit:
        if kv_tokens is None and kv_bytes is None:
            raise UsageError("the KV pool is missing: give --kv-pool-tokens N or --kv-pool-bytes B")
        if slots is None and state_bytes is None:
            raise UsageError("the state pool is missing: give --state-pool-slots S or --state-pool-bytes B")
    if budget_only is not None and (boot is not None or explicit):
        raise UsageError("--budget-bytes is for use without pools (with pools the budget is their sum)")

    # per-token / per-slot bytes
    layout, exact = None, True
    if model_given:
        layout, cost_source = _layout(args, boot)
        per_token, per_slot = layout.kv_bytes_per_token, layout.state_bytes_per_slot
        if boot is not None:  # exact pool bytes, and a check that the log matches the model and dtypes
            kv_exact, st_exact = boot["pages"] * layout.kv_bytes_per_page, slots * per_slot
            for what, logged, want in (("KV", boot["kv_gib"], kv_exact), ("state", boot["state_gib"], st_exact)):
                if abs(logged - want / GIB) > 0.0006 + 1e-3 * logged:
                    raise UsageError(
                        f"--boot-log: the {what} pool is {logged:.3f} GiB in the log but {want / GIB:.3f} GiB for "
                        f"{cost_source}: wrong --preset/--model, or pass --dtype/--kv-cache-dtype/--mamba-ssm-dtype")
            kv_bytes, state_bytes = float(kv_exact), float(st_exact)
    elif costs_given:
        per_token, per_slot = args.kv_bytes_per_token, args.state_bytes_per_slot
        cost_source = "--kv-bytes-per-token / --state-bytes-per-slot"
    else:
        exact = False
        cost_source = "estimated as pool bytes / pool size" + (" (GiB rounded to 1 MiB in the log)" if boot else "")
        if boot is None and not explicit:
            raise UsageError("give the pools (--boot-log FILE, or --kv-pool-tokens/--kv-pool-bytes and "
                             "--state-pool-slots/--state-pool-bytes) or the byte costs (--preset NAME, "
                             "--model DIR, or --kv-bytes-per-token and --state-bytes-per-slot)")
        for have, n, b, lacking in (("--kv-pool-tokens", kv_tokens, kv_bytes, "--kv-pool-bytes"),
                                    ("--state-pool-slots", slots, state_bytes, "--state-pool-bytes")):
            if n is None or b is None:
                given = have if b is None else lacking
                raise UsageError(f"{given} alone does not give the bytes per unit: add --preset NAME or --model DIR, "
                                 f"or --kv-bytes-per-token and --state-bytes-per-slot, or both "
                                 f"{have} and {lacking}")
        per_token, per_slot = kv_bytes / kv_tokens, state_bytes / slots
        if per_token <= 0 or per_slot <= 0:
            raise UsageError("the pool bytes are 0 (the boot log rounds to 1 MiB): add --preset NAME or --model DIR")

    # complete the pools from whichever of size / bytes was given
    if boot is None and explicit:
        if kv_tokens is None:
            kv_tokens = int(kv_bytes // per_token)
        if kv_bytes is None:
            kv_bytes = kv_tokens * per_token
        if slots is None:
            slots = int(state_bytes // per_slot)
        if state_bytes is None:
            state_bytes = slots * per_slot
        if kv_tokens < 1 or slots < 1:
            raise UsageError(f"the pools hold {kv_tokens} KV tokens and {slots} state slots: check the sizes")

    balanced = per_slot / (mean * per_token)
    out: dict = {
        "mean_request_len": mean, "kv_bytes_per_token": per_token, "state_bytes_per_slot": per_slot,
        "byte_costs": cost_source, "exact_byte_costs": exact, "pools": source if (boot or explicit) else None,
        "balanced_ratio": balanced,
        "formula": "r = state_bytes_per_slot / (mean_request_len * kv_bytes_per_token)",
    }
    budget = kv_bytes + state_bytes if kv_bytes is not None else budget_only
    if budget is not None:
        pin = int(budget * balanced / (1 + balanced) // per_slot)
        left_kv = budget - pin * per_slot
        ps = layout.page_size if layout is not None else 1
        out.update(budget_bytes=budget, max_mamba_cache_size=pin,
                   balanced_kv_pool_tokens=int(max(0.0, left_kv) // (per_token * ps)) * ps,
                   balanced_max_running_requests=max(1, pin // 2))
        if pin < 1:
            out["warning"] = "the budget cannot hold one state slot at the balanced ratio"
    if kv_bytes is not None:
        kv_cap = kv_tokens / mean
        factor = max(slots, kv_cap) / min(slots, kv_cap)
        bottleneck = "balanced" if factor < 1.01 else ("state" if slots < kv_cap else "kv")
        out.update(kv_pool_bytes=kv_bytes, kv_pool_tokens=kv_tokens, state_pool_bytes=state_bytes,
                   state_pool_slots=slots, current_ratio=state_bytes / kv_bytes,
                   kv_capacity_requests=kv_cap, state_capacity_requests=slots,
                   bottleneck=bottleneck, bottleneck_factor=factor,
                   max_running_requests_bound=max(1, slots // 2))
        if boot is not None:
            out["boot_log_max_running_requests"] = boot.get("max_running_requests")
            out["boot_log_clamp"] = boot.get("clamp")
            if boot["engines"] > 1:
                out["note"] = f"the log holds {boot['engines']} engine boots; used the last"
    return out


# ---- output ---------------------------------------------------------------------------------
def _fmt_count(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-9 else f"{x:,.2f}"


def describe(o: dict) -> str:
    lines = [f"mean request length   {_fmt_count(o['mean_request_len'])} tokens",
             f"KV bytes / token      {o['kv_bytes_per_token']:,.2f}",
             f"state bytes / slot    {o['state_bytes_per_slot']:,.2f}",
             f"  (byte costs: {o['byte_costs']})"]
    if "kv_pool_bytes" in o:
        lines += [
            f"pools now ({o['pools']}):",
            f"  KV pool             {o['kv_pool_bytes'] / GIB:.3f} GiB = {o['kv_pool_tokens']:,} tokens "
            f"= {o['kv_capacity_requests']:,.1f} requests of mean length",
            f"  state pool          {o['state_pool_bytes'] / GIB:.3f} GiB = {o['state_pool_slots']:,} slots",
            f"  total budget        {o['budget_bytes'] / GIB:.3f} GiB",
            f"current  --mamba-full-memory-ratio {o['current_ratio']:.4f}  (state : KV bytes)",
        ]
    lines.append(f"balanced --mamba-full-memory-ratio {o['balanced_ratio']:.4f}  "
                 f"(= state_bytes_per_slot / (mean_len x kv_bytes_per_token))")
    if "max_mamba_cache_size" in o:
        lines.append(f"equivalent --max-mamba-cache-size {o['max_mamba_cache_size']:,}  (same "
                     f"{o['budget_bytes'] / GIB:.3f} GiB budget; leaves {o['balanced_kv_pool_tokens']:,} KV tokens, "
                     f"max_running_requests <= {o['balanced_max_running_requests']:,})")
    if "bottleneck" in o:
        slots, kv_cap, f = o["state_pool_slots"], o["kv_capacity_requests"], o["bottleneck_factor"]
        if o["bottleneck"] == "balanced":
            lines.append(f"bottleneck now: none, the pools are balanced ({slots:,} slots, "
                         f"KV for {kv_cap:,.1f} requests)")
        elif o["bottleneck"] == "state":
            lines.append(f"bottleneck now: the state pool, {slots:,} slots while the KV pool holds "
                         f"{kv_cap:,.1f} requests of mean length ({f:.2f}x more): raise the ratio")
        else:
            lines.append(f"bottleneck now: the KV pool, KV for {kv_cap:,.1f} requests of mean length while the "
                         f"state pool has {slots:,} slots ({f:.2f}x more): lower the ratio")
        if o.get("boot_log_clamp"):
            lines.append(f"  (the boot log clamped max_running_requests to {o['boot_log_max_running_requests']}: "
                         f"{o['boot_log_clamp']})")
    for k in ("warning", "note"):
        if k in o:
            lines.append(f"{k}: {o[k]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        out = compute(args)
    except UsageError as e:
        print(f"glmrt compute-mamba-ratio: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else describe(out))
    return 0
