"""The full GLM-5.3-Flash on four and eight H200s, projected from bytes, FLOPs and collectives.

    python3 -m bench.projection [--preset flash] [--configs TP4,TP4+EP4,TP8,TP8+EP8]
        [--quantization bf16,fp8] [--batches 1,16,64,128] [--context 4096]
        [--hbm-efficiency 1.05] [--accept-length 3.7] [--draft-steps 5] [--collectives FILE.json]

A calculation on the CPU: no GPU, no weights. Rank 0 of each configuration is built on the
meta device by glmrt's own loader (bench/projection_parts.py), so the shards, the replicated
tensors and the FP8 conversions are the code's. Per layer, on the busiest rank:

  HBM ms    bytes / 4.09 TB/s (bench/h200.py) x --hbm-efficiency (default 1.05: the flash-4l
            bf16 decode step measured 1.02-1.08x its floor at batch 16-128)
  FLOP ms   16-bit FLOPs / 779 TFLOP/s + FP8 FLOPs / 1340 TFLOP/s
  layer     max(HBM, FLOP): a decode kernel streams its weights while it multiplies, so each
            layer is bound by the slower of the two; the sum would count that overlap twice.
  step      the layers' sum + the collectives, which glmrt runs on the compute stream between
            layers (nothing overlaps them).

Collectives, counted from the code (glmrt/parallel.py and the layers): one all-reduce of the
embedding (vocab-parallel lookup), two per decoder layer (attention o_proj; the MLP's down_proj
or the MoE's routed + shared partial sum), each of tokens x hidden x 2 bytes, and one
all-gather of the logits (tokens x vocab x 2 bytes). Expert parallelism as glmrt implements it
(TokenDispatcher) keeps every token on every rank: dispatch moves nothing and combine is that
same all-reduce, so EP changes which experts a rank reads (whole experts, the busiest rank
setting the pace) and not the traffic.

The collective times are ASSUMPTIONS unless --collectives gives measured ones. All-reduce up
to 1 MB: published H100 figures for 4 and 8 ranks on one NVSwitch host (SGLang's custom
all-reduce pull request, its table of the vLLM custom all-reduce kernel without CUDA graphs:
8.5-9.2 us from 512 B to 32 KB at 4 ranks, 20.6 us at 256 KB, 40.2 us at 1 MB; 9.3-11.8 us,
24.1 and 45.0 us at 8; 8.7-9.5, 12.9 and 26.6 us at 2), interpolated; a decode step's all-reduces are 8 KB (batch 1) to 1 MB
(batch 128) and sit on those points. Above 1 MB (the verify forward's), and for the logits'
all-gather, latency plus bytes over bus bandwidth in the convention of NVIDIA's nccl-tests:
t = lat + S x 2(n-1)/n / busbw for an all-reduce of S bytes, lat + S x (n-1)/n / busbw for an
all-gather of S bytes in all, with 8 us and 300 / 350 GB/s at 2 / 4 ranks, 10 us and 400 GB/s at 8 (below
the ~450 GB/s that nccl-tests reaches at large sizes on 8 NVSwitch-connected H100s). glmrt
calls NCCL through torch.distributed inside the decode CUDA graph, where NCCL's small-message
latency is of the same order (~6 us measured for NVLink SHARP at 2 ranks in a graph). Other
group sizes (more than one host) have no assumed figures: they need --collectives.

Speculation (MTP, K drafts, accepted length L, an assumption for the real model: the default
3.7 is the shipped tiny model's measured 3.64-3.83 at K = 5): a cycle is the verify forward of
b x (K+1) tokens (the decode step's bytes, with the routed experts those tokens reach; FLOPs
and collective messages x (K+1)) plus K draft steps of the MTP layer (its bytes, the LM head
it shares with the target, its collectives) -> b x L / cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_left

from bench.h200 import CEILING_TBPS, CEILING_TFLOPS, write_out

CEILING_FP8_TFLOPS = 1340.0  # the fp8 ceiling the prefill table of bench/RESULTS.md measures against
HBM_BYTES = 141e9            # one H200
# ranks -> (latency us, bus GB/s): assumed
DEFAULT_LINKS = {2: (8.0, 300.0), 4: (8.0, 350.0), 8: (10.0, 400.0)}
# ranks -> [(bytes, us)]: published H100 all-reduce times up to 1 MB (module docstring)
DEFAULT_ALLREDUCE = {2: [(512, 9.5), (4096, 8.8), (32768, 8.7), (262144, 12.9), (524288, 17.7), (1048576, 26.6)],
                     4: [(512, 9.1), (4096, 8.5), (32768, 9.2), (262144, 20.6), (524288, 26.9), (1048576, 40.2)],
                     8: [(512, 10.1), (4096, 9.3), (32768, 11.8), (262144, 24.1), (524288, 30.4),
                         (1048576, 45.0)]}
SGLANG = ("SGLang's published 11,459 tok/s at ~128 running requests, with DFlash2 drafting: "
          "7.03 accepted tokens per 74 ms cycle")
KINDS = ("allreduce", "all_gather")


class Collectives:
    """Time of one collective of S bytes on n ranks: measured tables where given (interpolated
    linearly between points; below the first point its time, above the last the last segment's
    slope), else the assumed figures: the published all-reduce points up to their last size,
    and beyond them (and for any all-gather) the latency + bandwidth model."""

    def __init__(self, links: dict[int, tuple[float, float]] | None = None,
                 assumed: dict[int, list[tuple[float, float]]] | None = None):
        self.links = dict(DEFAULT_LINKS if links is None else links)
        self.assumed = dict(DEFAULT_ALLREDUCE if assumed is None else assumed)
        self.tables: dict[tuple[str, int], list[tuple[float, float]]] = {}

    @staticmethod
    def parse(obj) -> tuple[int, dict[str, list[tuple[float, float]]]]:
        """A --collectives file: {"ranks": n, "allreduce": [[bytes, us], ...], "all_gather": [...]}
        (all_gather optional) -> (n, tables). Raises ValueError naming what is wrong."""
        if not isinstance(obj, dict) or not isinstance(obj.get("ranks"), int) or obj["ranks"] < 2:
            raise ValueError('needs "ranks" (the group size the times were measured on, >= 2)')
        extra = set(obj) - {"ranks", *KINDS}
        if extra:
            raise ValueError(f"unknown keys {sorted(extra)} (glmrt's expert parallelism sends no all-to-all: "
                             f"give {' and '.join(KINDS)})")
        if "allreduce" not in obj:
            raise ValueError('needs "allreduce": [[bytes, us], ...]')
        tables = {}
        for kind in KINDS:
            if kind not in obj:
                continue
            pts = obj[kind]
            ok = isinstance(pts, list) and pts and all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) and v >= 0 for v in p)
                for p in pts)
            if not ok:
                raise ValueError(f'"{kind}" must be a non-empty list of [bytes, us] pairs of numbers >= 0')
            pts = sorted((float(s), float(t)) for s, t in pts)
            if len({s for s, _ in pts}) != len(pts):
                raise ValueError(f'"{kind}" names a message size twice')
            tables[kind] = pts
        return obj["ranks"], tables

    def load(self, path: str) -> int:
        with open(path) as f:
            n, tables = self.parse(json.load(f))
        for kind, pts in tables.items():
            self.tables[(kind, n)] = pts
        return n

    @staticmethod
    def interpolate(pts: list[tuple[float, float]], size: float) -> float:
        xs = [s for s, _ in pts]
        if size <= xs[0]:
            return pts[0][1]
        if len(pts) == 1:  # one measured size: no slope to extend, so time in proportion to bytes
            return pts[0][1] * size / max(xs[0], 1.0)
        i = min(bisect_left(xs, size), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def source(self, kind: str, n: int) -> str:
        if (kind, n) in self.tables:
            return "measured"
        if kind == "all_gather" and ("allreduce", n) in self.tables:
            return "the measured all-reduce of half the bytes"
        lat, bw = self.link(n)
        model = f"{lat:g} us + bytes x {'2' if kind == 'allreduce' else '1'}(n-1)/n / {bw:g} GB/s"
        if kind == "allreduce" and n in self.assumed:
            pts = self.assumed[n]
            return (f"assumed: published H100 points {pts[0][1]:g}-{pts[-1][1]:g} us up to "
                    f"{pts[-1][0] / 2**20:g} MiB, beyond: + bytes x 2(n-1)/n / {bw:g} GB/s")
        return f"assumed: {model}"

    def known(self, n: int) -> bool:
        """Figures exist for a group of n ranks (assumed or measured)."""
        return n <= 1 or n in self.links or ("allreduce", n) in self.tables

    def link(self, n: int) -> tuple[float, float]:
        if n not in self.links:
            raise ValueError(f"no collective figures for {n} ranks (assumed ones exist for "
                             f"{', '.join(map(str, sorted(self.links)))}, one host): give --collectives for {n}")
        return self.links[n]

    def us(self, kind: str, n: int, size: float) -> float:
        if n <= 1:
            return 0.0
        if (kind, n) in self.tables:
            return self.interpolate(self.tables[(kind, n)], size)
        if kind == "all_gather" and ("allreduce", n) in self.tables:
            # a ring all-gather moves half an all-reduce's bytes: the measured all-reduce of 2x fewer
            return self.interpolate(self.tables[("allreduce", n)], size / 2)
        lat, bw = self.link(n)
        factor = 2 * (n - 1) / n if kind == "allreduce" else (n - 1) / n
        if kind == "allreduce" and n in self.assumed:
            pts = self.assumed[n]
            if size <= pts[-1][0]:
                return self.interpolate(pts, size)
            return pts[-1][1] + (size - pts[-1][0]) * factor / (bw * 1e3)
        return lat + size * factor / (bw * 1e3)  # GB/s = 1e3 bytes/us


def collective_ms(rm, parts, tokens: int, links: Collectives) -> float:
    """The collectives of one forward of `tokens` tokens through `parts` on a tp group."""
    t = rm.cfg.text
    n = rm.tp
    act = tokens * t.hidden_size * 2
    count = 1 + 2 * sum(1 for p in parts if p.kind != "head")  # embedding + 2 per layer
    us = count * links.us("allreduce", n, act) + links.us("all_gather", n, tokens * t.vocab_size * 2)
    return us / 1e3


def forward(rm, parts, b: int, context: int, args, links: Collectives, tokens_per_req: int = 1) -> dict:
    """One forward of b requests x tokens_per_req tokens through `parts`."""
    from bench.projection_parts import cache_bytes, step_bytes, token_flops

    tokens = b * tokens_per_req
    hbm = flop = layered = nbytes = cached = 0.0
    for p in parts:
        byt = step_bytes(rm, p, b, context, expert_tokens=tokens)
        cached += cache_bytes(rm, p, b, context)
        f16, f8 = token_flops(rm, p, context)
        h = byt / (CEILING_TBPS * 1e12) * 1e3 * args.hbm_efficiency
        f = tokens * (f16 / (CEILING_TFLOPS * 1e12) + f8 / (CEILING_FP8_TFLOPS * 1e12)) * 1e3
        nbytes += byt
        hbm += h
        flop += f
        layered += max(h, f)
    coll = collective_ms(rm, parts, tokens, links)
    return {"bytes": nbytes, "cache_bytes": cached, "hbm_ms": hbm, "flop_ms": flop, "coll_ms": coll,
            "ms": layered + coll}


def memory(rm, args) -> dict:
    """Weights per rank against 141 GB x mem_fraction, and the 4K-context requests the rest holds
    (pools split at the balanced ratio for 4K requests, one checkpoint slot each: glmrt.engine.memory)."""
    from glmrt.engine.memory import balanced_ratio, plan_memory

    budget = HBM_BYTES * args.mem_fraction - rm.weight_bytes
    row = {"weights_gb": rm.weight_bytes / 1e9, "replicated_gb": rm.replicated_bytes / 1e9,
           "cache_budget_gb": budget / 1e9, "fits": budget > 0, "requests_4k": 0}
    if budget <= 0:
        return row
    try:
        plan = plan_memory(rm.layout, int(budget), ratio=balanced_ratio(rm.layout, args.context),
                           max_running_requests=10 ** 7)
    except ValueError:
        row["fits"] = False
        return row
    pages_per_req = -(-args.context // rm.layout.page_size)
    row["requests_4k"] = min(plan.max_running_requests, plan.num_pages // pages_per_req)
    return row


def parse_configs(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        name = item.strip().upper()
        tp_s, _, ep_s = name.partition("+")
        if not tp_s.startswith("TP") or (ep_s and not ep_s.startswith("EP")):
            raise ValueError(f"--configs {item!r}: write TPn or TPn+EPn")
        tp = int(tp_s[2:])
        ep = int(ep_s[2:]) if ep_s else 1
        if tp < 1 or ep not in (1, tp):
            raise ValueError(f"--configs {item!r}: glmrt's EP size is 1 or the TP size")
        out.append((name, tp, ep))
    return out


def _args(argv):
    p = argparse.ArgumentParser(prog="python3 -m bench.projection", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash")
    p.add_argument("--configs", default="TP4,TP4+EP4,TP8,TP8+EP8")
    p.add_argument("--quantization", default="bf16,fp8", help="bf16, fp8, or both (comma-separated)")
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--hbm-efficiency", type=float, default=1.05,
                   help="measured step / HBM floor (flash-4l bf16 decode: 1.02-1.08 at batch 16-128)")
    p.add_argument("--accept-length", type=float, default=3.7,
                   help="accepted tokens per speculative cycle (assumed: the tiny model's measured 3.7 at K=5)")
    p.add_argument("--draft-steps", type=int, default=5, help="K: MTP draft steps per cycle")
    p.add_argument("--mem-fraction", type=float, default=0.9)
    p.add_argument("--collectives", action="append", default=[],
                   help='measured times, JSON {"ranks": n, "allreduce": [[bytes, us], ...], '
                        '"all_gather": [[bytes, us], ...]} (repeat for other group sizes)')
    a = p.parse_args(argv)
    try:
        a.config_list = parse_configs(a.configs)
        a.batch_list = [int(x) for x in a.batches.split(",")]
        a.quant_list = [q.strip() for q in a.quantization.split(",")]
    except ValueError as e:
        p.exit(2, f"projection: {e}\n")
    bad = None
    if any(q not in ("bf16", "fp8") for q in a.quant_list):
        bad = f"--quantization {a.quantization!r}: choose bf16, fp8 or bf16,fp8"
    elif any(b < 1 for b in a.batch_list):
        bad = "--batches must be positive"
    elif a.context < 1:
        bad = "--context must be positive"
    elif a.hbm_efficiency < 1:
        bad = "--hbm-efficiency is a measured step over its floor: >= 1"
    elif a.draft_steps < 1:
        bad = "--draft-steps must be >= 1"
    elif not 1 <= a.accept_length <= a.draft_steps + 1:
        bad = f"--accept-length must lie in [1, K+1 = {a.draft_steps + 1}]"
    elif not 0 < a.mem_fraction < 1:
        bad = "--mem-fraction must lie in (0, 1)"
    if bad:
        p.exit(2, f"projection: {bad}\n")
    return a, p


def project(args) -> tuple[list[dict], list[str], Collectives]:
    from glmrt.checkpoint.presets import preset_config
    from bench.projection_parts import rank_model

    links = Collectives()
    for path in args.collectives:
        links.load(path)
    for _, tp, _ in args.config_list:
        if not links.known(tp):
            links.link(tp)  # raises: names the group sizes that have figures
    cfg = preset_config(args.preset)
    rows = []
    for quant in args.quant_list:
        for name, tp, ep in args.config_list:
            rm = rank_model(cfg, tp, ep, quant)
            mem = memory(rm, args)
            mtp = rm.mtp()
            for b in args.batch_list:
                step = forward(rm, rm.target(), b, args.context, args, links)
                row = {"config": name, "tp": tp, "ep": ep, "weights": quant, "batch": b, "context": args.context,
                       "gpus": tp, **{k: v for k, v in step.items()}, "tok_s": b / step["ms"] * 1e3, **mem}
                if mtp is not None:
                    k = args.draft_steps
                    verify = forward(rm, rm.target(), b, args.context, args, links, tokens_per_req=k + 1)
                    draft = forward(rm, [mtp, rm.head()], b, args.context, args, links)
                    cycle = verify["ms"] + k * draft["ms"]
                    row.update(verify_ms=verify["ms"], draft_ms=draft["ms"], cycle_ms=cycle,
                               mtp_tok_s=b * args.accept_length / cycle * 1e3)
                rows.append(row)
    t = cfg.text
    whole = rank_model(cfg, 1, 1, "bf16")
    notes = [
        f"model: preset {args.preset}, {whole.params / 1e9:.1f} B parameters (text + MTP layer; the vision "
        f"tower is not counted), {t.num_hidden_layers} layers ({len(t.kda_layers)} KDA, {len(t.dsa_layers)} DSA), "
        f"{t.n_routed_experts} experts top-{t.num_experts_per_tok}; counted from rank 0 built on the meta device",
        f"decode at context {args.context}: every dense weight once, the routed experts reached under uniform "
        f"routing E(1-(1-k/E)^tokens) (under EP: the expected busiest rank's), <= {t.index_topk} + "
        f"{t.index_kpool - 1} latent rows and the pooled keys per DSA layer, KDA state read + written",
        f"HBM: {CEILING_TBPS} TB/s x {args.hbm_efficiency} (measured step / floor, flash-4l bf16, batch 16-128)",
        f"FLOPs: {CEILING_TFLOPS:g} TFLOP/s bf16, {CEILING_FP8_TFLOPS:g} TFLOP/s fp8 (w8a8); per layer "
        "max(HBM, FLOP), summed over layers, + collectives",
        "collectives: per forward 1 + 2 x layers all-reduces of tokens x hidden x 2 B, 1 all-gather of the "
        "logits; EP as glmrt implements it adds no traffic (every rank holds every token)",
    ]
    for n in sorted({tp for _, tp, _ in args.config_list if tp > 1}):
        notes.append(f"  {n} ranks: all-reduce {links.source('allreduce', n)}; all-gather "
                     f"{links.source('all_gather', n)}")
    notes += [
        f"speculation: K = {args.draft_steps} MTP drafts, accepted length {args.accept_length} per cycle "
        "(ASSUMED for the real model: the shipped tiny model measured 3.64-3.83 at K = 5); cycle = verify of "
        "b x (K+1) tokens + K MTP-layer steps (with the shared LM head)",
        f"memory: {HBM_BYTES / 1e9:g} GB x mem_fraction {args.mem_fraction} per GPU; 4K reqs: requests of "
        f"{args.context} tokens the KV + state pools hold after the weights (no activation workspace counted)",
        f"reference, beside the four-GPU rows: {SGLANG}",
    ]
    return rows, notes, links


def print_table(rows: list[dict]) -> None:
    print(f"{'config':>9} {'weights':>7} {'batch':>5} {'GB/rank':>8} {'HBM ms':>7} {'FLOP ms':>7} "
          f"{'coll ms':>7} {'step ms':>7} {'tok/s':>8} {'MTP tok/s':>9} {'fits':>4} {'4K reqs':>7}")
    for r in rows:
        fits = "yes" if r["fits"] else "no"
        tok = f"{r['tok_s']:>8,.0f}" if r["fits"] else f"{'-':>8}"
        mtp = f"{r['mtp_tok_s']:>9,.0f}" if r["fits"] and "mtp_tok_s" in r else f"{'-':>9}"
        print(f"{r['config']:>9} {r['weights']:>7} {r['batch']:>5} {r['bytes'] / 1e9:>8.2f} {r['hbm_ms']:>7.2f} "
              f"{r['flop_ms']:>7.2f} {r['coll_ms']:>7.2f} {r['ms']:>7.2f} {tok} {mtp} {fits:>4} "
              f"{r['requests_4k']:>7}")


def main(argv=None) -> list[dict]:
    args, parser = _args(argv)
    try:
        rows, notes, _ = project(args)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        parser.exit(2, f"projection: {e}\n")
    print("assumptions:")
    for n in notes:
        print(f"  {n}")
    mem = {(r["config"], r["weights"]): r for r in rows}
    print("\nmemory per GPU:")
    for (cfg, q), r in mem.items():
        print(f"  {cfg:>9} {q:>5}: weights {r['weights_gb']:.1f} GB ({r['replicated_gb']:.1f} GB replicated), "
              f"cache budget {r['cache_budget_gb']:.1f} GB -> " + (f"{r['requests_4k']} requests of {r['context']} "
              f"tokens" if r["fits"] else "does not fit"))
    write_out("projection.json", {"assumptions": notes, "rows": rows})
    print()
    print_table(rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
