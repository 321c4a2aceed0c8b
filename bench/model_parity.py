"""Our model against the Hugging Face reference, same device, same weights (copied in memory).

    python -m bench.model_parity --preset flash-4l --dtype bfloat16 --device cuda \\
        --prompt-len 2560 --decode-steps 16 --chunk 1024 --seed 0 [--out results.json]

1. Build ours with random weights (`load_dummy`, no MTP) and copy them into transformers'
   `Glm5NextForConditionalGeneration` (bench/hf_reference.py). Our fp32 mHC parameters are
   first rounded to the model dtype, because HF stores them in it: otherwise the two models
   would not hold the same weights (`--keep-fp32-mhc` keeps ours unrounded).
2. Ours: a random prompt (ids below the 60 special tokens) prefilled in `--chunk` pieces
   through `DirectSession`, then `--decode-steps` greedy steps of one token.
3. HF: one full forward (eager, no cache) over prompt + our greedy tokens (teacher forcing:
   both see the same ids); or, with `--hf-chunk N`, HF's own cached path N tokens at a time.
4. Logits compared at every position, prefill and decode separately: max |err|, mean |err|,
   max |err| / max |ref|, top-1 agreement. Times: our prefill, our mean decode step, HF forward.
5. Noise floor (`hf-self` rows, skipped with `--no-hf-self-check` or `--hf-chunk`): HF's
   cached path on our schedule (prefill chunks, then single tokens) against its own full
   forward. In bf16 both differences are rounding noise amplified by the model (on random
   flash-4l weights one-ulp changes flip top-8-of-288 routing for a few % of tokens per
   layer, and the flips cascade), so judge ours-vs-HF against HF-vs-HF, not a tolerance.
6. With `--fp32-ref-device DEV`: an fp32 HF copy of the same weights on DEV (flash-4l: a
   second H200) is the truth, and ours and HF (both bf16) are each compared against it:
   ours is as accurate as HF when the `ours-fp32` rows match the `hf-fp32` rows.

Memory: flash-4l is 58.6 GiB per copy, so both models take 117.2 GiB of the H200's 139.8 GiB
(21.8 GiB free after building both). HF's eager forward over S tokens needs ~6 MiB per token
for the KDA torch fallback's decay masks (3 x [H=64, 64, 128] fp32 per token) plus
8 * 64 * S^2 bytes for the DSA scores. Estimated / measured on an H200: 17.3 / 16.2 GiB at
S = 2576, 19.0 / 17.8 GiB at 2832, 20.2 / 19.0 GiB at 3016. The default prompt (2560 + 16
decode = 2576 > index_topk 2048, so sparse selection drops tokens) leaves ~5.6 GiB free;
the plan allows up to 3072. The plan is printed first and a run that would not fit stops
before building anything (`--force` runs it anyway; `--prompt-len auto` takes the longest
prompt that fits; `--hf-chunk 1024` runs HF's cached path: ~21k tokens by the estimate, not run).

Imports only torch, transformers and our packages glmrt/backends.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench.hf_reference import (
    build_hf_from_ours,
    estimate_hf_activation_bytes,
    hf_logits,
    hf_logits_incremental,
    round_ours_to_hf_,
)

GiB = 1 << 30
NUM_SPECIAL_TOKENS = 60
DEFAULT_PROMPT_LEN = 2560
RESERVE_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspaces, allocator slack (per device)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # DirectSession has no float16


# ---- memory plan ----------------------------------------------------------------------------

def _meta_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(our weight bytes, HF's weight bytes), counted on the meta device."""
    from transformers import Glm5NextForConditionalGeneration

    from bench.hf_reference import _cast_meta, hf_config, model_bytes
    from glmrt.model.glm5_next import Glm5NextForCausalLM

    with torch.device("meta"):
        ours = Glm5NextForCausalLM(config, None, dtype, with_vision=True, with_mtp=False)
        hf = Glm5NextForConditionalGeneration(hf_config(config))
    _cast_meta(hf, dtype)
    return model_bytes(ours), model_bytes(hf)


def estimate_ours_prefill_bytes(text, chunk: int, total: int, dtype: torch.dtype) -> int:
    """Our reference ops' largest prefill temporaries: the [H, chunk, T] fp32 scores of
    sparse MLA (scores, masked copy, softmax) and its cast, plus per-head K/V over T."""
    e = torch.finfo(dtype).bits // 8
    h = text.num_attention_heads
    scores = (12 + e) * h * chunk * total if text.dsa_layers else 0
    kv = h * total * (text.qk_nope_head_dim + text.v_head_dim) * e
    kda = 3 * text.linear_num_heads * 64 * 64 * text.linear_head_dim * 4 if text.kda_layers else 0
    return scores + kv + kda + chunk * text.vocab_size * (e + 4)


def _hf_cached_estimate(text, chunk: int, total: int, dtype: torch.dtype) -> dict:
    est = estimate_hf_activation_bytes(text, min(chunk, total), dtype, kv_len=total)
    # HF's DynamicCache: per-head K and V + the packed indexer state, per DSA layer and token
    cache = total * len(text.dsa_layers) * (
        text.num_attention_heads * (text.qk_head_dim + text.v_head_dim)
        + 2 * text.index_head_dim + 1) * (torch.finfo(dtype).bits // 8)
    est["peak_bytes"] += cache
    est["cache_bytes"] = float(cache)
    return est


def plan_memory(text, ours_w: int, hf_w: int, prompt_len: int, decode_steps: int, chunk: int,
                dtype: torch.dtype, hf_chunk: int = 0, devices: tuple[str, str] = ("dev", "dev"),
                self_check: bool = True, ref32: tuple[str, int] | None = None) -> dict:
    """Bytes each device needs: `devices` = (ours, HF); `ref32` = (device, weight bytes) of the
    optional fp32 HF reference. Per device: its weights + its largest activation estimate
    (they run one after the other; the estimates ran 6-7% above the peaks measured on an H200)
    + a fixed reserve.

    HF's peak is its full forward (or, with `hf_chunk`, its cached forward); the HF self-check
    runs the cached path with our chunk size afterwards, so it only counts if larger.
    """
    total = prompt_len + decode_steps
    hf = _hf_cached_estimate(text, hf_chunk, total, dtype) if hf_chunk else \
        estimate_hf_activation_bytes(text, total, dtype)
    hf_act = hf["peak_bytes"]
    if self_check and not hf_chunk:
        hf_act = max(hf_act, _hf_cached_estimate(text, chunk, total, dtype)["peak_bytes"])
    ours_act = estimate_ours_prefill_bytes(text, min(chunk, prompt_len), total, dtype)
    loads: dict[str, list[float]] = {}

    def add(dev: str, weights: int, act: float) -> None:
        w, a = loads.get(dev, [0, 0.0])
        loads[dev] = [w + weights, max(a, act)]

    add(devices[0], ours_w, ours_act)
    add(devices[1], hf_w, hf_act)
    ref32_act = None
    if ref32 is not None:
        ref32_act = estimate_hf_activation_bytes(text, total, torch.float32)["peak_bytes"]
        add(ref32[0], ref32[1], ref32_act)
    need = {dev: int(w + a) + RESERVE_BYTES for dev, (w, a) in loads.items()}
    return {"hf_activation": hf, "hf_activation_bytes": hf_act, "ours_prefill_bytes": ours_act,
            "ref32_activation_bytes": ref32_act, "required_bytes": need}


def _fits(plan: dict, capacity: dict) -> bool:
    return all(capacity.get(k) is None or v <= capacity[k] for k, v in plan["required_bytes"].items())


def longest_fitting_prompt(text, ours_w: int, hf_w: int, capacity: dict, decode_steps: int, chunk: int,
                           dtype: torch.dtype, step: int = 256, **plan_kw) -> int:
    best, p = 0, step
    while p <= 1 << 20:
        if not _fits(plan_memory(text, ours_w, hf_w, p, decode_steps, chunk, dtype, **plan_kw), capacity):
            break
        best, p = p, p + step
    return best


# ---- comparison -----------------------------------------------------------------------------

def compare_logits(ours: torch.Tensor, ref: torch.Tensor, rows: int = 256) -> dict | None:
    """ours, ref [n, V] (any dtype, same device) -> error metrics, computed in fp32 by row blocks."""
    n = ours.shape[0]
    if n == 0:
        return None
    if ours.shape != ref.shape:
        raise ValueError(f"logit shapes differ: ours {tuple(ours.shape)}, ref {tuple(ref.shape)}")
    max_abs, sum_abs, max_ref, agree, first_miss = 0.0, 0.0, 0.0, 0, None
    for s in range(0, n, rows):
        a, b = ours[s:s + rows].float(), ref[s:s + rows].float()
        d = (a - b).abs()
        max_abs = max(max_abs, d.max().item())
        sum_abs += d.sum(dtype=torch.float64).item()
        max_ref = max(max_ref, b.abs().max().item())
        eq = a.argmax(-1) == b.argmax(-1)
        agree += int(eq.sum())
        if first_miss is None and not bool(eq.all()):
            first_miss = s + int((~eq).nonzero()[0, 0])
    return {"positions": n, "max_abs_err": max_abs, "mean_abs_err": sum_abs / (n * ours.shape[1]),
            "max_abs_ref": max_ref, "max_rel_err": max_abs / max_ref if max_ref else math.inf,
            "top1_agreement": agree / n, "first_top1_mismatch": first_miss}


# ---- the run --------------------------------------------------------------------------------

def _device(name: str) -> torch.device:
    d = torch.device(name)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _sync(*devices: torch.device) -> None:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _free(*devices: torch.device) -> None:
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()


def _peak_start(d: torch.device) -> int:
    if d.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(d)
    return torch.cuda.memory_allocated(d)


def _peak(d: torch.device, base: int) -> int | None:
    return torch.cuda.max_memory_allocated(d) - base if d.type == "cuda" else None


def _gib(x: float | int | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.model_parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-4l", help="tiny | flash-4l | flash")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hf-device", default=None, help="HF's device (default: --device)")
    ap.add_argument("--fp32-ref-device", default=None,
                    help="also run an fp32 HF copy on this device and compare ours and HF against it "
                         "(the bf16 error of each vs the truth; flash-4l needs a second H200 for it)")
    ap.add_argument("--prompt-len", default=str(DEFAULT_PROMPT_LEN),
                    help=f"prompt tokens, or 'auto' for the longest that fits (default {DEFAULT_PROMPT_LEN})")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1024, help="our prefill chunk size")
    ap.add_argument("--hf-chunk", type=int, default=0,
                    help="0: HF full forward without cache (default); N: HF's cached path, N tokens at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto", help="our kernel set (backends.registry name)")
    ap.add_argument("--hf-experts", default="eager", help="HF experts implementation: eager | grouped_mm | ...")
    ap.add_argument("--keep-fp32-mhc", action="store_true",
                    help="do not round our fp32 mHC parameters to the model dtype (HF rounds its copy)")
    ap.add_argument("--no-hf-self-check", action="store_true", help="skip the HF cached-vs-full noise floor")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--force", action="store_true", help="run even if the memory plan says it will not fit")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    from backends.registry import get_backend
    from glmrt.checkpoint.presets import preset_config
    from glmrt.model.loader import load_dummy
    from glmrt.model.session import DirectSession

    args = parse_args(argv)
    device, dtype = _device(args.device), DTYPES[args.dtype]
    hf_dev = _device(args.hf_device) if args.hf_device else device
    ref_dev = _device(args.fp32_ref_device) if args.fp32_ref_device and dtype != torch.float32 else None
    self_check = not args.no_hf_self_check and not args.hf_chunk
    config = preset_config(args.preset)
    text = config.text
    steps, chunk = args.decode_steps, args.chunk

    # -- memory plan, before building anything
    ours_w, hf_w = _meta_bytes(config, dtype)
    ref_w = _meta_bytes(config, torch.float32)[1] if ref_dev else None
    used = [device, hf_dev] + ([ref_dev] if ref_dev else [])
    capacity = {str(d): torch.cuda.get_device_properties(d).total_memory if d.type == "cuda" else None for d in used}
    on_gpu = any(v is not None for v in capacity.values())
    plan_kw = dict(hf_chunk=args.hf_chunk, devices=(str(device), str(hf_dev)), self_check=self_check,
                   ref32=(str(ref_dev), ref_w) if ref_dev else None)
    fit_max = longest_fitting_prompt(text, ours_w, hf_w, capacity, steps, chunk, dtype, **plan_kw) \
        if on_gpu else None
    if args.prompt_len == "auto":
        if not on_gpu:
            raise SystemExit("--prompt-len auto needs a CUDA device (it sizes the prompt to its memory)")
        prompt_len = fit_max
    else:
        prompt_len = int(args.prompt_len)
    if prompt_len < 1 or steps < 0 or chunk < 1:
        raise SystemExit("--prompt-len and --chunk must be >= 1, --decode-steps >= 0")
    total = prompt_len + steps
    plan = plan_memory(text, ours_w, hf_w, prompt_len, steps, chunk, dtype, **plan_kw)
    hf_act = plan["hf_activation"]
    parts = ", ".join(f"{k[:-6]} {_gib(v)}" for k, v in hf_act.items() if k.endswith("_bytes") and k != "peak_bytes")
    where = f"{device}" + (f" (HF on {hf_dev})" if hf_dev != device else "")
    print(f"[plan] {args.preset} {args.dtype} on {where}: weights ours {_gib(ours_w)} + HF {_gib(hf_w)}"
          + (f"; fp32 HF reference {_gib(ref_w)} on {ref_dev}" if ref_dev else ""))
    print(f"[plan] HF {'full forward' if not args.hf_chunk else f'cached forward in {args.hf_chunk}-token chunks'}"
          f" over {total} tokens: peak activations ~{_gib(hf_act['peak_bytes'])} in {hf_act['peak_part']} "
          f"({parts}); with the self-check ~{_gib(plan['hf_activation_bytes'])}; "
          f"ours prefill ~{_gib(plan['ours_prefill_bytes'])}")
    if on_gpu:
        need = ", ".join(f"{k}: {_gib(v)} of {_gib(capacity[k])}" for k, v in plan["required_bytes"].items())
        print(f"[plan] required ~{need}; longest prompt that fits: {fit_max}")
        if not _fits(plan, capacity) and not args.force:
            raise SystemExit(f"[plan] prompt {prompt_len} + {steps} does not fit: use --prompt-len {fit_max} "
                             "(or 'auto'), --hf-chunk 1024, --no-hf-self-check, or --force")
    if total <= text.index_topk:
        print(f"[plan] note: {total} tokens <= index_topk {text.index_topk}: sparse selection keeps every token")

    # -- build both models
    backend = get_backend(args.backend, device.type)
    t0 = time.perf_counter()
    ours = load_dummy(config, backend.ops, dtype=dtype, device=device, seed=args.seed, with_mtp=False)
    rounded = [] if args.keep_fp32_mhc else round_ours_to_hf_(ours, dtype)
    _sync(device)
    t_ours = time.perf_counter() - t0
    _free(device)  # the random init's fp32 temporaries
    t0 = time.perf_counter()
    hf = build_hf_from_ours(ours, hf_dev, dtype, experts=args.hf_experts)
    _sync(device, hf_dev)
    t_hf = time.perf_counter() - t0
    _free(device, hf_dev)
    print(f"[build] ours {t_ours:.1f} s ({backend.name} kernels), HF copy {t_hf:.1f} s"
          + (f"; {len(rounded)} fp32 mHC tensors of ours rounded to {args.dtype}" if rounded else ""))
    for d in {device, hf_dev}:
        if d.type == "cuda":
            free, _ = torch.cuda.mem_get_info(d)
            print(f"[build] {d}: allocated {_gib(torch.cuda.memory_allocated(d))}, free {_gib(free)}")

    vocab = text.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab - NUM_SPECIAL_TOKENS, (prompt_len,), generator=g)

    if not args.no_warmup:  # first-call costs (cuBLAS handles, allocator growth) stay out of the timings
        warm = prompt[: min(16, prompt_len)]
        sess = DirectSession(ours, max_requests=1, max_tokens=len(warm) + 1)
        sess.step({sess.new_request(): warm}, all_logits=False)
        del sess
        with torch.no_grad():
            hf(input_ids=warm[None].to(hf_dev), use_cache=False, logits_to_keep=1)
        _sync(device, hf_dev)
        _free(device, hf_dev)

    # -- ours: chunked prefill, then greedy decode one token at a time
    base = _peak_start(device)
    sess = DirectSession(ours, max_requests=1, max_tokens=total)
    rid = sess.new_request()
    ours_prefill, t_prefill = [], 0.0
    for s in range(0, prompt_len, chunk):
        _sync(device)
        t0 = time.perf_counter()
        out = sess.step({rid: prompt[s:s + chunk]}, all_logits=True)[rid]
        _sync(device)
        t_prefill += time.perf_counter() - t0
        ours_prefill.append(out.cpu())
        del out
    ours_prefill = torch.cat(ours_prefill)
    tokens = [int(ours_prefill[-1].float().argmax())]
    ours_decode, t_steps = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = sess.step({rid: [tokens[-1]]}, all_logits=True)[rid]
        nxt = int(out[-1].float().argmax())  # the sync a real decode loop has too
        t_steps.append(time.perf_counter() - t0)
        ours_decode.append(out.cpu())
        tokens.append(nxt)
        del out
    ours_decode = torch.cat(ours_decode) if ours_decode else ours_prefill[:0]
    ours_peak = _peak(device, base)
    del sess
    _free(device)

    # -- HF: the whole sequence at once (teacher forcing with our greedy tokens)
    ids = torch.cat([prompt, torch.tensor(tokens[:steps], dtype=torch.long)])[None]
    base = _peak_start(hf_dev)
    _sync(hf_dev)
    t0 = time.perf_counter()
    if args.hf_chunk:
        sizes = [min(args.hf_chunk, prompt_len - s) for s in range(0, prompt_len, args.hf_chunk)] + [1] * steps
        ref = hf_logits_incremental(hf, ids, sizes)
    else:
        ref = hf_logits(hf, ids)
    _sync(hf_dev)
    t_hf_fwd = time.perf_counter() - t0
    hf_peak = _peak(hf_dev, base)
    ref = ref[0].cpu()
    _free(hf_dev)

    # -- noise floor: HF's cached path on our schedule against HF's full forward
    hf_self = None
    if self_check:
        base = _peak_start(hf_dev)
        sizes = [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)] + [1] * steps
        alt = hf_logits_incremental(hf, ids, sizes)[0].cpu()
        hf_self = {"prefill": compare_logits(alt[:prompt_len], ref[:prompt_len]),
                   "decode": compare_logits(alt[prompt_len:], ref[prompt_len:]),
                   "measured_bytes": _peak(hf_dev, base)}
        del alt
        _free(hf_dev)

    # -- the fp32 truth: how far each bf16 model is from it
    ref32 = None
    if ref_dev is not None:
        hf32 = build_hf_from_ours(ours, ref_dev, torch.float32, experts=args.hf_experts)
        base = _peak_start(ref_dev)
        truth = hf_logits(hf32, ids)[0].cpu()
        ref32 = {"ours_prefill": compare_logits(ours_prefill, truth[:prompt_len]),
                 "ours_decode": compare_logits(ours_decode, truth[prompt_len:]),
                 "hf_prefill": compare_logits(ref[:prompt_len], truth[:prompt_len]),
                 "hf_decode": compare_logits(ref[prompt_len:], truth[prompt_len:]),
                 "measured_bytes": _peak(ref_dev, base)}
        del hf32, truth
        _free(ref_dev)

    result = {
        "preset": args.preset, "dtype": args.dtype, "device": str(device), "hf_device": str(hf_dev),
        "fp32_ref_device": str(ref_dev) if ref_dev else None,
        "backend": backend.name, "prompt_len": prompt_len, "decode_steps": steps, "chunk": chunk,
        "seed": args.seed, "hf_mode": "full" if not args.hf_chunk else f"cached/{args.hf_chunk}",
        "hf_experts": args.hf_experts, "mhc_rounded_to_dtype": bool(rounded), "index_topk": text.index_topk,
        "prefill": compare_logits(ours_prefill, ref[:prompt_len]),
        "decode": compare_logits(ours_decode, ref[prompt_len:]),
        "hf_self": hf_self, "fp32_ref": ref32, "greedy_tokens": tokens[:steps],
        "time_s": {"ours_build": t_ours, "hf_build": t_hf, "ours_prefill": t_prefill,
                   "ours_decode_step_mean": sum(t_steps) / len(t_steps) if t_steps else None,
                   "hf_forward": t_hf_fwd},
        "memory": {"capacity_bytes": capacity, "weights_ours_bytes": ours_w, "weights_hf_bytes": hf_w,
                   "hf_activation_estimate_bytes": hf_act["peak_bytes"], "hf_activation_measured_bytes": hf_peak,
                   "ours_prefill_estimate_bytes": plan["ours_prefill_bytes"], "ours_run_measured_bytes": ours_peak,
                   "required_estimate_bytes": plan["required_bytes"], "longest_fitting_prompt": fit_max},
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print_table(result)
    return result


def print_table(r: dict) -> None:
    t, m = r["time_s"], r["memory"]
    where = r["device"] + (f" (HF on {r['hf_device']})" if r["hf_device"] != r["device"] else "")
    lines = [f"model parity: {r['preset']} {r['dtype']} on {where}, {r['backend']} vs HF {r['hf_mode']}, "
             f"prompt {r['prompt_len']} + {r['decode_steps']} decode, chunk {r['chunk']}, seed {r['seed']}"
             + (f", fp32 reference on {r['fp32_ref_device']}" if r.get("fp32_ref") else ""),
             f"{'':17} {'pos':>6} {'max_abs':>10} {'mean_abs':>10} {'max_rel':>10} {'top1':>8}"]
    rows = [("prefill", r["prefill"]), ("decode", r["decode"])]
    if r["hf_self"]:
        rows += [("hf-self prefill", r["hf_self"]["prefill"]), ("hf-self decode", r["hf_self"]["decode"])]
    if r.get("fp32_ref"):
        rows += [(f"{who}-fp32 {part}", r["fp32_ref"][f"{who}_{part}"])
                 for who in ("ours", "hf") for part in ("prefill", "decode")]
    for name, c in rows:
        if c is None:
            lines.append(f"{name:17} {0:>6} {'-':>10} {'-':>10} {'-':>10} {'-':>8}")
        else:
            lines.append(f"{name:17} {c['positions']:>6} {c['max_abs_err']:>10.3e} {c['mean_abs_err']:>10.3e} "
                         f"{c['max_rel_err']:>10.3e} {c['top1_agreement']:>8.4f}")
    dec = t["ours_decode_step_mean"]
    lines.append(f"{'time':17} ours prefill {t['ours_prefill']:.3f} s "
                 f"({r['prompt_len'] / t['ours_prefill']:.0f} tok/s), ours decode "
                 f"{'-' if dec is None else f'{dec * 1e3:.1f} ms/step'}, HF forward {t['hf_forward']:.3f} s")
    if m["hf_activation_measured_bytes"] is not None:
        lines.append(f"{'memory':17} HF activations est {_gib(m['hf_activation_estimate_bytes'])}, "
                     f"measured {_gib(m['hf_activation_measured_bytes'])}; ours run measured "
                     f"{_gib(m['ours_run_measured_bytes'])}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
