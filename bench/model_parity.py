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

Memory: flash-4l is ~58.6 GiB per copy, so both models take ~117 GiB of the H200's ~140 GiB.
HF's eager forward over S tokens needs ~6 MiB per token for the KDA torch fallback's decay
masks (3 x [H=64, 64, 128] fp32 per token) plus 8 * 64 * S^2 bytes for the DSA scores,
about 17 GiB at S = 2576: the default prompt (2560 + 16 decode = 2576 > index_topk 2048, so
sparse selection drops tokens) is the longest multiple of 256 that fits with margin.
The plan is printed first and a run that would not fit stops before building anything
(`--force` runs it anyway; `--prompt-len auto` takes the longest prompt that fits).

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
RESERVE_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspaces, allocator slack
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


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


def plan_memory(text, weights: int, prompt_len: int, decode_steps: int, chunk: int, dtype: torch.dtype,
                hf_chunk: int = 0) -> dict:
    total = prompt_len + decode_steps
    if hf_chunk:
        hf = estimate_hf_activation_bytes(text, min(hf_chunk, total), dtype, kv_len=total)
        # HF's cache: per-head K and V + packed indexer state per DSA layer and token
        cache = total * len(text.dsa_layers) * (
            text.num_attention_heads * (text.qk_head_dim + text.v_head_dim)
            + 2 * text.index_head_dim + 1) * (torch.finfo(dtype).bits // 8)
        hf["peak_bytes"] += cache
        hf["cache_bytes"] = float(cache)
    else:
        hf = estimate_hf_activation_bytes(text, total, dtype)
    ours = estimate_ours_prefill_bytes(text, min(chunk, prompt_len), total, dtype)
    act = max(hf["peak_bytes"], ours)
    # +5% for allocator fragmentation on top of the fixed reserve
    need = weights + int(1.05 * act) + RESERVE_BYTES
    return {"weights_bytes": weights, "hf_activation": hf, "ours_prefill_bytes": ours,
            "activation_bytes": act, "required_bytes": need}


def longest_fitting_prompt(text, weights: int, capacity: int, decode_steps: int, chunk: int,
                           dtype: torch.dtype, hf_chunk: int = 0, step: int = 256) -> int:
    best, p = 0, step
    while p <= 1 << 20:
        if plan_memory(text, weights, p, decode_steps, chunk, dtype, hf_chunk)["required_bytes"] > capacity:
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

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gib(x: float | int | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.model_parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-4l", help="tiny | flash-4l | flash")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = preset_config(args.preset)
    text = config.text
    steps, chunk = args.decode_steps, args.chunk

    # -- memory plan, before building anything
    ours_w, hf_w = _meta_bytes(config, dtype)
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    fit_max = longest_fitting_prompt(text, ours_w + hf_w, capacity, steps, chunk, dtype, args.hf_chunk) \
        if capacity else None
    if args.prompt_len == "auto":
        if not capacity:
            raise SystemExit("--prompt-len auto needs a CUDA device (it sizes the prompt to its memory)")
        prompt_len = fit_max
    else:
        prompt_len = int(args.prompt_len)
    if prompt_len < 1 or steps < 0 or chunk < 1:
        raise SystemExit("--prompt-len and --chunk must be >= 1, --decode-steps >= 0")
    total = prompt_len + steps
    plan = plan_memory(text, ours_w + hf_w, prompt_len, steps, chunk, dtype, args.hf_chunk)
    hf_act = plan["hf_activation"]
    parts = ", ".join(f"{k[:-6]} {_gib(v)}" for k, v in hf_act.items() if k.endswith("_bytes") and k != "peak_bytes")
    print(f"[plan] {args.preset} {args.dtype} on {device}: weights ours {_gib(ours_w)} + HF {_gib(hf_w)}")
    print(f"[plan] HF {'full forward' if not args.hf_chunk else f'cached forward in {args.hf_chunk}-token chunks'}"
          f" over {total} tokens: peak activations ~{_gib(hf_act['peak_bytes'])} in {hf_act['peak_part']} "
          f"({parts}); ours prefill ~{_gib(plan['ours_prefill_bytes'])}")
    if capacity:
        print(f"[plan] required ~{_gib(plan['required_bytes'])} of {_gib(capacity)}; "
              f"longest prompt that fits: {fit_max}")
        if plan["required_bytes"] > capacity and not args.force:
            raise SystemExit(f"[plan] prompt {prompt_len} + {steps} does not fit on {device}: use --prompt-len "
                             f"{fit_max} (or 'auto'), --hf-chunk 1024, or --force")
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
    hf = build_hf_from_ours(ours, device, dtype, experts=args.hf_experts)
    _sync(device)
    t_hf = time.perf_counter() - t0
    _free(device)
    print(f"[build] ours {t_ours:.1f} s ({backend.name} kernels), HF copy {t_hf:.1f} s"
          + (f"; {len(rounded)} fp32 mHC tensors of ours rounded to {args.dtype}" if rounded else ""))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        print(f"[build] allocated {_gib(torch.cuda.memory_allocated(device))}, free {_gib(free)}")

    vocab = text.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab - NUM_SPECIAL_TOKENS, (prompt_len,), generator=g)

    if not args.no_warmup:  # first-call costs (cuBLAS handles, allocator growth) stay out of the timings
        warm = prompt[: min(16, prompt_len)]
        sess = DirectSession(ours, max_requests=1, max_tokens=len(warm) + 1)
        sess.step({sess.new_request(): warm}, all_logits=False)
        del sess
        with torch.no_grad():
            hf(input_ids=warm[None].to(device), use_cache=False, logits_to_keep=1)
        _sync(device)
        _free(device)

    # -- ours: chunked prefill, then greedy decode one token at a time
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
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
    ours_decode = torch.cat(ours_decode) if ours_decode else ours_prefill[:0]
    ours_peak = torch.cuda.max_memory_allocated(device) - base_alloc if device.type == "cuda" else None
    del sess, out
    _free(device)

    # -- HF: the whole sequence at once (teacher forcing with our greedy tokens)
    ids = torch.cat([prompt, torch.tensor(tokens[:steps], dtype=torch.long)])[None]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    _sync(device)
    t0 = time.perf_counter()
    if args.hf_chunk:
        sizes = [min(args.hf_chunk, prompt_len - s) for s in range(0, prompt_len, args.hf_chunk)] + [1] * steps
        ref = hf_logits_incremental(hf, ids, sizes)
    else:
        ref = hf_logits(hf, ids)
    _sync(device)
    t_hf_fwd = time.perf_counter() - t0
    hf_peak = torch.cuda.max_memory_allocated(device) - base_alloc if device.type == "cuda" else None
    ref = ref[0].cpu()
    _free(device)

    prefill = compare_logits(ours_prefill, ref[:prompt_len])
    decode = compare_logits(ours_decode, ref[prompt_len:])
    result = {
        "preset": args.preset, "dtype": args.dtype, "device": str(device), "backend": backend.name,
        "prompt_len": prompt_len, "decode_steps": steps, "chunk": chunk, "seed": args.seed,
        "hf_mode": "full" if not args.hf_chunk else f"cached/{args.hf_chunk}", "hf_experts": args.hf_experts,
        "mhc_rounded_to_dtype": bool(rounded), "index_topk": text.index_topk,
        "prefill": prefill, "decode": decode, "greedy_tokens": tokens[:steps],
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
    lines = [f"model parity: {r['preset']} {r['dtype']} on {r['device']} ({r['backend']} vs HF {r['hf_mode']}), "
             f"prompt {r['prompt_len']} + {r['decode_steps']} decode, chunk {r['chunk']}, seed {r['seed']}",
             f"{'':8} {'pos':>6} {'max_abs':>10} {'mean_abs':>10} {'max_rel':>10} {'top1':>8}"]
    for name in ("prefill", "decode"):
        c = r[name]
        if c is None:
            lines.append(f"{name:8} {0:>6} {'-':>10} {'-':>10} {'-':>10} {'-':>8}")
        else:
            lines.append(f"{name:8} {c['positions']:>6} {c['max_abs_err']:>10.3e} {c['mean_abs_err']:>10.3e} "
                         f"{c['max_rel_err']:>10.3e} {c['top1_agreement']:>8.4f}")
    dec = t["ours_decode_step_mean"]
    lines.append(f"{'time':8} ours prefill {t['ours_prefill']:.3f} s ({r['prompt_len'] / t['ours_prefill']:.0f} tok/s), "
                 f"ours decode {'-' if dec is None else f'{dec * 1e3:.1f} ms/step'}, HF forward {t['hf_forward']:.3f} s")
    if m["hf_activation_measured_bytes"] is not None:
        lines.append(f"{'memory':8} HF activations est {_gib(m['hf_activation_estimate_bytes'])}, "
                     f"measured {_gib(m['hf_activation_measured_bytes'])}; ours run measured "
                     f"{_gib(m['ours_run_measured_bytes'])}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
