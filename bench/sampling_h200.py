"""On-GPU sampling (backends.kernels.sampling) against the torch sampler, on an H200.

    python3 -m bench.sampling_h200              # checks + timings, V = 154880, B = 1, 16, 64, 128
    python3 -m bench.sampling_h200 --sweep      # + the select kernel gathering in one program per row
                                                # and sorting CAP wide, the split gather alone, and a
                                                # smaller capacity
    python3 -m bench.sampling_h200 --smoke      # tiny sizes; on a CPU-only machine it runs the
                                                # kernels in Triton's interpreter
    python3 -m bench.sampling_h200 --compile-only   # no GPU needed: build the four kernels for
                                                # sm_90 and print ptxas' registers and spills

Checks (fresh random inputs each; logits like a model's: a bf16-rounded gaussian bulk plus a
few hundred peaked ids per row, some -inf ids), printed as `check ... ok/FAIL`:
* greedy rows: the kernel's token is torch's first argmax, for every row;
* with the same exponentials, the kernel's token equals the torch sampler's (its own sort-based
  cuts `sampler._filter`, then argmax(z - log E)) and it keeps as many ids, for each scenario;
  a row whose two top-p cuts differ only at positions whose exclusive mass is within 1e-5 of
  top_p (the two sum in different orders) is counted apart as a rounding tie, not a failure;
* `Sampler(use_kernel=True)` and `Sampler(use_kernel=False)` give the same tokens from the
  same RNG state (greedy, seeded, unseeded, penalties, min_tokens, logprobs in one batch);
* a seeded row gives the same tokens alone and at another position of a B=64 batch;
* chi-square of 40 x 128 kernel draws of one row against softmax of the torch cut;
* every output written (outputs poisoned with -1 first).

Timings per batch B and scenario (median of repeated calls, L2 flushed by do_bench):
  torch ms    `Sampler(use_kernel=False).sample` end to end (host wall clock, its sync included)
  kernel ms   `Sampler(use_kernel=True).sample` end to end (noise draw, upload, 3 launches, sync)
  dev us      the kernels alone (`sampling.sample` with the noise drawn), do_bench median
  noise us    the B x V exponential_ draw that both paths make
  floor us    B*V*4 bytes (the logits read once) at 4.09 TB/s (the measured H200 copy ceiling)
Scenarios: "decode" (T 0.6-1.0, top_k 20-50, top_p 0.8-0.95, some min_p), "top_p" (T=1,
top_p=0.95: GLM's generation config, a large nucleus here), "min_p" (T=1, min_p=0.02),
"temp" (T=0.8, no cut), "greedy". Per-kernel times come from torch.profiler where it works.
A short table is printed last; with $OUT set, everything also goes to $OUT/sampling_h200.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TBPS, interpret_if_smoke, write_out  # noqa: E402
from bench.timing import profile_events  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from backends.kernels import sampling as ks  # noqa: E402
from glmrt.engine import sampler as sm  # noqa: E402
from glmrt.engine.sampler import Sampler, SamplerRow  # noqa: E402
from glmrt.sampling_params import SamplingParams  # noqa: E402

TINY = torch.finfo(torch.float32).tiny
SCENARIOS = ("decode", "top_p", "min_p", "temp", "greedy")
SWEEP = [dict(capacity=4096, config=dict(split_gather=False, small_sort=1 << 30)),  # one program gathers, wide sort
         dict(capacity=4096, config=dict(small_sort=1 << 30)),  # split gather, wide sort
         dict(capacity=2048, config=dict(block=2048, pblock=256, warps=8))]


def row(generator=None, output=(), prompt=(), eos=(), **params):
    return SamplerRow(SamplingParams(**params), list(prompt), list(output), generator, list(eos))


def make_logits(b: int, v: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    """A model-like row: bf16-rounded gaussian bulk, ~256 peaked ids, a few -inf ids in some rows."""
    x = torch.randn(b, v, device=dev, generator=g) * 2.0 - 2.0
    peaks = torch.randint(0, v, (b, min(256, v // 4)), device=dev, generator=g)
    x.scatter_(1, peaks, torch.randn(peaks.shape, device=dev, generator=g) * 3.0 + 6.0)
    x = x.to(torch.bfloat16).float()
    blocked = torch.randint(0, v, (b, 4), device=dev, generator=g)
    x.scatter_(1, blocked[: b // 4], -math.inf)
    return x


def scenario_params(name: str, b: int, g: torch.Generator) -> list[dict]:
    r = torch.rand(b, 4, generator=g, device=g.device).tolist()
    out = []
    for i in range(b):
        if name == "decode":
            out.append(dict(temperature=0.6 + 0.4 * r[i][0], top_k=(20, 40, 50, -1)[int(r[i][1] * 4)],
                            top_p=0.8 + 0.15 * r[i][2], min_p=0.05 if r[i][3] < 0.3 else 0.0))
        elif name == "top_p":
            out.append(dict(temperature=1.0, top_k=-1, top_p=0.95, min_p=0.0))
        elif name == "min_p":
            out.append(dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.02))
        elif name == "temp":
            out.append(dict(temperature=0.8, top_k=-1, top_p=1.0, min_p=0.0))
        else:
            out.append(dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0))
    return out


def packed(params: list[dict], v: int, dev: torch.device) -> torch.Tensor:
    greedy = [p["temperature"] == 0 for p in params]
    return ks.pack_params([1.0 if gr else max(p["temperature"], 1e-5) for p, gr in zip(params, greedy)],
                          [v if gr else p["top_k"] for p, gr in zip(params, greedy)],
                          [1.0 if gr else p["top_p"] for p, gr in zip(params, greedy)],
                          [0.0 if gr else p["min_p"] for p, gr in zip(params, greedy)],
                          [-1 if gr else i for i, gr in enumerate(greedy)], v).to(dev)


def reference(x: torch.Tensor, params: list[dict], noise: torch.Tensor | None):
    """The torch sampler's cut and race on the same exponentials: (tokens, kept counts)."""
    if noise is None:
        return x.argmax(dim=-1), torch.ones(x.shape[0], dtype=torch.long, device=x.device)
    z = sm._filter(x.clone(), [row(**p) for p in params])
    return (z - noise.clamp_min(TINY).log()).argmax(dim=-1), (z > -math.inf).sum(dim=1)


def rounding_tie(x_row: torch.Tensor, p: dict, n_a: int, n_b: int) -> bool:
    """Whether two kept counts differ only where top-p's cut is within rounding (1e-5) of top_p.

    Every position between the two cuts must have a top-k-renormalised exclusive mass (float64,
    from the same fp32 z) within 1e-5 of top_p: the kernel and torch sum the masses in
    different orders, so either side of such a position is a right answer.
    """
    if p["top_p"] >= 1.0 or n_a == n_b:
        return n_a == n_b
    v = x_row.shape[0]
    z = x_row / torch.tensor(max(p["temperature"], 1e-5), dtype=torch.float32, device=x_row.device)
    zs = z[z.sort(descending=True, stable=True).indices].double()
    k = p["top_k"] if 0 < p["top_k"] < v else v
    zs[k:] = -math.inf
    pr = torch.softmax(zs, dim=0)
    excl = torch.cumsum(pr, dim=0) - pr
    lo, hi = sorted((n_a, n_b))
    return bool(((excl[lo:hi] - p["top_p"]).abs() < 1e-5).all())


def run_kernel(x, prm, noise, capacity=ks.DEFAULT_CAPACITY, config=None):
    b = x.shape[0]
    out = torch.full((b,), -1, dtype=torch.long, device=x.device)
    info = torch.full((b, 2), -1, dtype=torch.int32, device=x.device)
    ks.sample(x, prm, noise, out=out, info=info, capacity=capacity, config=config)
    return out, info


# ---- checks ------------------------------------------------------------------------------
def check_exact(v, b, dev, g, results, capacity=ks.DEFAULT_CAPACITY, config=None, tag=""):
    for name in SCENARIOS:
        x = make_logits(b, v, dev, g)
        params = scenario_params(name, b, g)
        prm = packed(params, v, dev)
        noise = None if name == "greedy" else torch.empty(b, v, device=dev).exponential_(generator=g)
        tokens, info = run_kernel(x, prm, noise, capacity, config)
        ref, kept = reference(x, params, noise)
        written = bool((tokens >= 0).all()) and bool((info[:, 0] >= 0).all())
        tok_bad = kept_bad = rounding = 0
        for i in torch.nonzero((tokens != ref) | (info[:, 0].long() != kept if noise is not None else tokens != ref)
                               ).flatten().tolist():
            if noise is not None and rounding_tie(x[i], params[i], int(info[i, 0]), int(kept[i])):
                rounding += 1  # top-p's cut within rounding: both answers are right
                continue
            tok_bad += int(tokens[i] != ref[i])
            kept_bad += int(noise is not None and int(info[i, 0]) != int(kept[i]))
        ok = written and tok_bad == 0 and kept_bad == 0
        paths = info[:, 1].tolist()
        results["checks"].append(dict(check=f"exact{tag}", scenario=name, batch=b, ok=ok, written=written,
                                      token_mismatches=tok_bad, kept_mismatches=kept_bad, rounding_ties=rounding,
                                      refine_rows=sum(1 for p in paths if p & 0xFFFF00),
                                      race_pass_rows=sum(1 for p in paths if p & 32),
                                      mean_kept=float(info[:, 0].float().mean())))
        print(f"check exact{tag:8s} {name:7s} B={b:3d}: tokens {b - tok_bad}/{b}, kept {b - kept_bad}/{b} "
              f"({rounding} top-p cuts within rounding), written {written} -> {'ok' if ok else 'FAIL'}", flush=True)


def check_sampler_paths(v, dev, g, results):
    b = 12
    logits = make_logits(b, v, dev, g).to(torch.bfloat16)
    logits[:, 0] += 4

    def rows(step, gens):
        return [row(temperature=0.0), row(top_k=1, temperature=0.7, generator=gens[0]),
                row(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, generator=gens[1], output=[3, 3, step]),
                row(temperature=1.1, top_p=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                    prompt=[1, 2, 5], output=[5, step]),
                row(temperature=0.6, min_p=0.1, logprobs=True, top_logprobs=3, generator=gens[2]),
                row(temperature=1.0, min_tokens=4, eos=[0], stop_token_ids=[7], output=[step]),
                row(temperature=1.3, top_k=7), row(temperature=0.8, top_k=900, top_p=0.97, generator=gens[3]),
                row(temperature=1.0, top_p=0.95), row(temperature=1.0, top_p=0.95, generator=gens[4]),
                row(temperature=0.7), row(temperature=0.0, logprobs=True, top_logprobs=5)]

    gk = [torch.Generator(device=dev).manual_seed(50 + i) for i in range(5)]
    gt = [torch.Generator(device=dev).manual_seed(50 + i) for i in range(5)]
    bad = 0
    for step in range(4):
        torch.manual_seed(900 + step)
        a = Sampler(use_kernel=True).sample(logits, rows(step, gk))
        torch.manual_seed(900 + step)
        t = Sampler(use_kernel=False).sample(logits, rows(step, gt))
        bad += sum(x != y for x, y in zip(a.tokens, t.tokens))
        bad += int(a.logprobs != t.logprobs) + int(a.top_logprobs != t.top_logprobs)
        bad += sum(not torch.equal(p.get_state(), q.get_state()) for p, q in zip(gk, gt))
    ok = bad == 0
    results["checks"].append(dict(check="sampler_paths", ok=ok, mismatches=bad))
    print(f"check sampler kernel path == torch path (4 steps x {b} mixed rows): mismatches {bad} -> "
          f"{'ok' if ok else 'FAIL'}", flush=True)


def check_seeded(v, dev, g, results):
    params = dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01)
    own = [make_logits(1, v, dev, g)[0] for _ in range(5)]
    fill = [make_logits(64, v, dev, g) for _ in range(5)]

    def seq(position, batch):
        gen = torch.Generator(device=dev).manual_seed(4242)
        out = []
        for step in range(5):
            x = fill[step][:batch].clone()
            x[position] = own[step]
            rows = [row(temperature=1.0, top_p=0.9) for _ in range(batch)]
            rows[position] = row(generator=gen, **params)
            out.append(Sampler(use_kernel=True).sample(x, rows).tokens[position])
        return out

    alone, inside = seq(0, 1), seq(37, 64)
    ok = alone == inside
    results["checks"].append(dict(check="seeded_batch_independence", ok=ok, alone=alone, inside=inside))
    print(f"check seeded row alone == at row 37 of 64: {alone} vs {inside} -> {'ok' if ok else 'FAIL'}", flush=True)


def check_distribution(v, dev, g, results, batches=40, b=128):
    base = make_logits(1, v, dev, g)
    params = dict(temperature=0.9, top_k=8, top_p=0.97, min_p=0.0)
    probs = torch.softmax(sm._filter(base.clone(), [row(**params)])[0].double(), dim=-1)
    support = {i: p for i, p in enumerate(probs.tolist()) if p > 0}
    x = base.expand(b, v).contiguous()
    counts: Counter = Counter()
    sampler = Sampler(use_kernel=True)
    for _ in range(batches):
        counts.update(sampler.sample(x, [row(**params) for _ in range(b)]).tokens)
    n = batches * b
    outside = sum(c for t, c in counts.items() if t not in support)
    chi2 = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in support.items())
    df = len(support) - 1
    limit = df + 6 * math.sqrt(2 * df) if df else 0.0  # ~6 sigma of the chi-square
    ok = outside == 0 and chi2 < limit
    results["checks"].append(dict(check="distribution", ok=ok, draws=n, chi2=chi2, df=df, outside=outside))
    print(f"check distribution: {n} draws over {len(support)} kept ids, chi2 {chi2:.1f} (df {df}, "
          f"limit {limit:.1f}), outside the support {outside} -> {'ok' if ok else 'FAIL'}", flush=True)


# ---- timing ------------------------------------------------------------------------------
def _wall_ms(fn, reps):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _dev_us(fn, smoke):
    if smoke or not torch.cuda.is_available():
        return _wall_ms(fn, 2) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3


def _profile(fn, reps=10):
    """Mean GPU time per call of each kernel (name -> us) via torch.profiler, or {}."""
    try:
        return {k[:40]: us for k, (us, _) in profile_events(fn, reps)["kernels"].items()}
    except Exception as e:  # pragma: no cover - profiler availability varies
        return {"error": repr(e)[:200]}


def time_case(v, b, name, dev, g, args, capacity=ks.DEFAULT_CAPACITY, config=None):
    x = make_logits(b, v, dev, g)
    params = scenario_params(name, b, g)
    prm = packed(params, v, dev)
    noise = None if name == "greedy" else torch.empty(b, v, device=dev).exponential_(generator=g)
    tokens, info = run_kernel(x, prm, noise, capacity, config)
    rows = [row(**p) for p in params]
    reps = 3 if args.smoke else 20
    rec = dict(scenario=name, batch=b, vocab=v, capacity=capacity, config=config or {})
    rec["torch_ms"] = _wall_ms(lambda: Sampler(use_kernel=False).sample(x, rows), reps)
    rec["kernel_ms"] = _wall_ms(lambda: Sampler(use_kernel=True).sample(x, rows), reps)
    rec["dev_us"] = _dev_us(lambda: ks.sample(x, prm, noise, capacity=capacity, config=config), args.smoke)
    rec["noise_us"] = 0.0 if noise is None else _dev_us(
        lambda: torch.empty(b, v, device=dev).exponential_(), args.smoke)
    rec["floor_us"] = b * v * 4 / (CEILING_TBPS * 1e12) * 1e6
    rec["tbps"] = b * v * 4 / (rec["dev_us"] * 1e-6) / 1e12
    paths = info[:, 1].tolist()
    rec["refine_rows"] = sum(1 for p in paths if p & 0xFFFF00)
    rec["race_pass_rows"] = sum(1 for p in paths if p & 32)
    rec["mean_kept"] = float(info[:, 0].float().mean())
    if dev.type == "cuda" and not args.smoke and not args.no_profile:
        rec["kernels_us"] = _profile(lambda: ks.sample(x, prm, noise, capacity=capacity, config=config))
    return rec


def compile_only(capacity: int = ks.DEFAULT_CAPACITY) -> None:
    """Build the kernels for sm_90 with Triton's bundled ptxas (no GPU), as a launch would
    specialise them (pointers and V, strides, chunk divisible by 16), and print ptxas -v."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    p, i = "*fp32", "*i32"
    common = dict(X=p, stride_x="i32", PRM=i)
    specs = {
        "_stats_kernel": (dict(common, E=p, PF=p, PI=i, V="i32", CHUNK="i32"), dict(BLOCK=1024, INTERPRET=False)),
        "_pivot_kernel": (dict(common, PF=p, PI=i, DTAB=p, PC=i, PM=p, V="i32", CHUNK="i32"),
                          dict(NSP=32, NP=ks.NUM_PIVOTS, PBLOCK=256)),
        "_split_gather_kernel": (dict(common, PF=p, PI=i, DTAB=p, PC=i, PM=p, BUF="*i64", GOT=i, V="i32",
                                      CHUNK="i32"),
                                 dict(NSP=32, NP=ks.NUM_PIVOTS, CAP=capacity, BLOCK=1024)),
        "_select_kernel": (dict(common, E=p, PF=p, PI=i, DTAB=p, PC=i, PM=p, BUF="*i64", GOT=i, OUT="*i64", INFO=i,
                                V="i32", NS="i32"),
                           dict(NSP=32, NP=ks.NUM_PIVOTS, CAP=capacity, BLOCK=1024, PBLOCK=256, MAXIT=12,
                                INTERPRET=False, SPLIT_GATHER=True, SMALL=ks.SMALL_SORT)),
    }
    pt = get_ptxas(90)
    ptxas = pt.path if hasattr(pt, "path") else pt[0]
    for name, (sig, cx) in specs.items():
        fn = getattr(ks, name)
        sig = dict(sig, **dict.fromkeys(cx, "constexpr"))
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, ty in sig.items()
                 if ty.startswith("*") or a in ("stride_x", "V", "CHUNK")}
        t = time.time()
        k = triton.compile(ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in cx.items()},
                                     attrs=attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(k.asm["ptx"])
            r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                               capture_output=True, text=True)
        info = [ln.split("info    :")[-1].strip() for ln in (r.stderr + r.stdout).splitlines()
                if "registers" in ln or "spill" in ln]
        print(f"{name:15s} built in {time.time() - t:5.1f} s, shared {k.metadata.shared} B | {' | '.join(info)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    v = 1500 if args.smoke else 154880
    batches = (1, 4) if args.smoke else (1, 16, 64, 128)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    results: dict = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
                         torch=torch.__version__, triton=triton.__version__, vocab=v, checks=[], timings=[],
                         sweep=[])
    print(f"device {results['device']}, torch {torch.__version__}, triton {triton.__version__}, V={v}", flush=True)

    t0 = time.time()
    for name, fn in (("exact", lambda: check_exact(v, 4 if args.smoke else 128, dev, g, results)),
                     ("exact B=1", lambda: check_exact(v, 1, dev, g, results)),
                     ("sampler", lambda: check_sampler_paths(v, dev, g, results)),
                     ("seeded", lambda: check_seeded(v, dev, g, results)),
                     ("distribution", lambda: check_distribution(v, dev, g, results,
                                                                 *((2, 16) if args.smoke else ())))):
        try:
            fn()
        except Exception:
            traceback.print_exc()
            results["checks"].append(dict(check=name, ok=False, error=traceback.format_exc()[-2000:]))
            print(f"check {name}: ERROR -> FAIL", flush=True)
    print(f"checks done in {time.time() - t0:.0f} s (includes compilation)", flush=True)

    for b in batches:
        for name in SCENARIOS:
            try:
                rec = time_case(v, b, name, dev, g, args)
            except Exception:
                traceback.print_exc()
                rec = dict(scenario=name, batch=b, error=traceback.format_exc()[-2000:])
            results["timings"].append(rec)
            print(json.dumps({k: (round(x, 2) if isinstance(x, float) else x) for k, x in rec.items()
                              if k != "kernels_us"}), flush=True)
            if "kernels_us" in rec:
                print("   kernels (us/call):", {k: round(t, 1) for k, t in rec["kernels_us"].items()
                                                if isinstance(t, float)}, flush=True)

    if args.sweep:
        for variant in SWEEP:
            try:
                check_exact(v, 128 if not args.smoke else 4, dev, g, results, variant["capacity"], variant["config"],
                            tag=f" c{variant['capacity']}")
                for b in batches:
                    for name in ("decode", "top_p"):
                        rec = time_case(v, b, name, dev, g, args, variant["capacity"], variant["config"])
                        results["sweep"].append(rec)
            except Exception:
                traceback.print_exc()
                results["sweep"].append(dict(variant=variant, error=traceback.format_exc()[-2000:]))

    write_out("sampling_h200.json", results)

    bad = [c for c in results["checks"] if not c.get("ok")]
    print()
    print(f"checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok"
          + ("" if not bad else "  FAILED: " + ", ".join(f"{c['check']}:{c.get('scenario', '')}" for c in bad)))
    print(f"{'scenario':8s} {'B':>4s} {'torch ms':>9s} {'kernel ms':>9s} {'speedup':>7s} {'dev us':>8s} "
          f"{'noise us':>8s} {'floor us':>8s} {'dev/floor':>9s} {'TB/s':>5s} {'refine':>6s} {'racep':>5s} {'kept':>7s}")
    for r in results["timings"] + results["sweep"]:
        if "error" in r:
            print(f"{r.get('scenario', '?'):8s} {r.get('batch', 0):4d} ERROR")
            continue
        tag = r["scenario"]
        if r in results["sweep"]:
            c = r["config"]
            tag = (f"{tag[:3]}-1prog" if c.get("split_gather") is False else f"{tag[:3]}-wide" if "small_sort" in c
                   else f"{tag[:3]}c{r['capacity'] // 1024}k{c.get('block')}w{c.get('warps')}")
        print(f"{tag:8s} {r['batch']:4d} {r['torch_ms']:9.3f} {r['kernel_ms']:9.3f} "
              f"{r['torch_ms'] / r['kernel_ms']:7.2f} {r['dev_us']:8.1f} {r['noise_us']:8.1f} {r['floor_us']:8.1f} "
              f"{r['dev_us'] / r['floor_us']:9.1f} {r['tbps']:5.2f} {r['refine_rows']:6d} {r['race_pass_rows']:5d} "
              f"{r['mean_kept']:7.0f}")


if __name__ == "__main__":
    main()
