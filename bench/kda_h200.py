"""KDA on the cuda-h200 backend: our conv kernels and fla-core's KDA kernels, checked and timed.

    python3 -m bench.kda_h200              # H200; needs fla-core 0.6.0 (bench/README.md)
    python3 -m bench.kda_h200 --smoke      # tiny sizes; on a CPU-only machine in Triton's interpreter

Full size: H 64 heads, dk = dv = 128, conv over C = 3·8192 channels with K = 4, bf16 model
dtype, fp32 recurrent state (and a bf16-state decode row), slots scattered in a pool.

Floors (4.09 TB/s measured copy ceiling, ~790 TFLOP/s bf16 dense):
* decode KDA: every request reads and writes its [64, 128, 128] fp32 state once: 8.39 MB per
  request per layer (B=128: 1.07 GB -> 263 us); ~6 MFLOP per token: memory-bound.
* prefill KDA, T = 8192: q, k, v bf16 + g fp32 read, o bf16 written once: 805 MB -> 197 us;
  chunked FLOPs ~(10·C²·d + 6·C·d²) per 64-token chunk and head = 11.5 MFLOP -> 94 GFLOP ->
  119 us: memory-bound at the floor, though fla's chunk pipeline also writes and re-reads
  per-chunk states and the intra-chunk factors, so expect a few times the floor.
* conv prefill: x read + out written, 8192 x 24576 bf16: 805 MB -> 197 us; decode: per request
  K-1 history rows read and written + x + out: 8 x 48 KiB (B=128: 50 MB -> 12 us).

Checks (fresh random inputs per case, outputs poisoned with NaN where the API lets us, new
requests' slots filled with NaN): every result against ReferenceOps evaluated in fp32 on the
same rounded inputs (‖out - ref‖/‖ref‖; bf16 bound 1e-2, fp32 ~1e-5 for our kernels and tf32
level ~1e-3 for fla's chunk path), the slots of the batch against the reference's, and the
decode step captured in a CUDA graph then replayed with new slot ids, prefix lengths (some 0)
and inputs: graph safety as a result. Times: triton.testing.do_bench medians (L2 flushed);
the reference's: median of 3 event-timed calls. A short table is printed last; with $OUT set
everything is written to $OUT/kda_h200.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.h200 import CEILING_TBPS, interpret_if_smoke, kernel_device, write_out  # noqa: E402

interpret_if_smoke()

import torch  # noqa: E402
import triton  # noqa: E402

from bench import timing  # noqa: E402

from backends.cuda_h200 import CudaH200Ops  # noqa: E402
from backends.kernels import conv as kconv  # noqa: E402
from backends.kernels import kda as kk  # noqa: E402
from backends.meta import BatchMeta  # noqa: E402
from backends.reference import ReferenceOps  # noqa: E402

FULL = dict(h=64, dk=128, dv=128, c=3 * 8192, k=4, prefill_t=8192, prefill_splits=(1, 4, 16), decode=(1, 16, 64, 128),
            mixed=(2048, 127))
SMOKE = dict(h=2, dk=16, dv=16, c=48, k=4, prefill_t=80, prefill_splits=(1, 4), decode=(1, 3), mixed=(40, 3))


def _rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


def _meta(prefix, seqs, slots, dev):
    return BatchMeta.build(prefix, seqs, slots, [[0]] * len(seqs), 1 << 30, dev)


def _kda_inputs(n, d, dtype, dev, gen):
    h, dk, dv = d["h"], d["dk"], d["dv"]
    r = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    return (r(n, h, dk).to(dtype), r(n, h, dk).to(dtype), r(n, h, dv).to(dtype),
            -5.0 * torch.sigmoid(2 * r(n, h, dk)),               # the model's bounded gate, in (-5, 0)
            torch.sigmoid(r(n, h)).to(dtype))


GATE_FLOOR = -5.0  # _kda_inputs' gates are the model's, bounded below by -5 (ops.kda's gate_floor)


def _pool(slots, d, dtype, dev, gen):
    return (0.3 * torch.randn(slots, d["h"], d["dk"], d["dv"], device=dev, generator=gen)).to(dtype)


def _batch(seed, prefix, seqs, d, dev, gen, state_dtype):
    """(meta, slots, pool, new): the batch's slots shuffled in a pool of 2B + 3, the slots of new
    requests (prefix 0) filled with NaN (the op must ignore them)."""
    b = len(seqs)
    n_slots = 2 * b + 3
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(seed))[:b].tolist()
    pool = _pool(n_slots, d, state_dtype, dev, gen)
    new = [s for s, p in zip(slots, prefix) if p == 0]
    pool[new] = float("nan")
    return _meta(prefix, seqs, slots, dev), slots, pool, new


def _rate(row, ms, state_bytes, io_bytes) -> None:
    """The time and bandwidth columns of a case's row."""
    row.update(us=ms * 1e3, state_bytes=state_bytes, io_bytes=io_bytes,
               tbps=(state_bytes + io_bytes) / (ms * 1e-3) / 1e12)
    row["pct_ceiling"] = 100 * row["tbps"] / CEILING_TBPS


def kda_case(name, prefix, seqs, d, dev, gen, timers, *, dtype=torch.bfloat16, state_dtype=torch.float32,
             split_decode=True, ref=True) -> dict:
    """One batch through kk.kda: error vs the fp32 reference (output and the batch's slots), time,
    state bytes and bandwidth."""
    kernel_ms, ref_ms = timers
    b = len(seqs)
    meta, slots, pool, new = _batch(len(name) + b, prefix, seqs, d, dev, gen, state_dtype)
    q, k, v, g, beta = _kda_inputs(sum(seqs), d, dtype, dev, gen)
    row = dict(case=name, kind="kda", reqs=b, tokens=sum(seqs), dtype=str(dtype)[6:], state=str(state_dtype)[6:],
               split_decode=split_decode, safe_gate=kk.safe_gate(GATE_FLOOR))
    if ref:
        truth_pool = pool.float().clone()
        truth_pool[new] = 0.0
        truth = ReferenceOps().kda(q.float(), k.float(), v.float(), g, beta.float(), truth_pool, meta)
        st = pool.clone()
        out = kk.kda(q, k, v, g, beta, st, meta, split_decode=split_decode, gate_floor=GATE_FLOOR)
        used = [s for s, n in zip(slots, seqs) if n > 0]
        row.update(out_rel=_rel(out, truth), state_rel=_rel(st[used].float(), truth_pool[used]),
                   max_abs=float((out.float() - truth).abs().max()))
        del truth_pool, truth, st, out
    t = kernel_ms(lambda: kk.kda(q, k, v, g, beta, pool, meta, split_decode=split_decode, gate_floor=GATE_FLOOR))
    sb = d["h"] * d["dk"] * d["dv"] * pool.element_size()
    state_bytes = sum(2 * sb for n in seqs if n > 0)
    io_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, g, beta)) + v.numel() * v.element_size()
    _rate(row, t, state_bytes, io_bytes)
    if dev.type == "cuda" and all(s == 1 for s in seqs):
        # the decode op captured in a CUDA graph (as the step runs it): no host launch cost, which
        # bounds the eager time below 64 rows (measured on the H200: ~50-190 µs whatever the tile)
        try:
            row["graph_us"] = timing.graph_ms(lambda: kk.kda(q, k, v, g, beta, pool, meta,
                                                              split_decode=split_decode)) * 1e3
            row["graph_pct_ceiling"] = 100 * (state_bytes + io_bytes) / (row["graph_us"] * 1e-6) / 1e12 / CEILING_TBPS
        except Exception as err:  # noqa: BLE001 - a failed capture is a result, not the end of the bench
            row["graph_error"] = f"{type(err).__name__}: {err}"[:200]
    if all(s == 1 for s in seqs):  # the bare fla kernel, for the op's overhead (zeroing, copies)
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        qc, kc, vc = q.contiguous()[None], k.contiguous()[None], v.contiguous()[None]
        o = torch.empty_like(vc)
        row["fla_kernel_us"] = kernel_ms(lambda: fused_recurrent_kda_fwd(
            qc, kc, vc, g[None], beta[None], initial_state=pool, scale=d["dk"] ** -0.5, inplace_final_state=True,
            cu_seqlens=meta.cu_seqlens_t, ssm_state_indices=meta.slot_ids, use_qk_l2norm_in_kernel=True,
            out=o)) * 1e3
    if ref and (dev.type == "cuda" or sum(seqs) <= 128):
        rp = pool.float().clone()
        rp[new] = 0.0
        row["ref_us"] = ref_ms(lambda: ReferenceOps().kda(q, k, v, g, beta, rp, meta)) * 1e3
        row["speedup"] = row["ref_us"] / row["us"]
    print(name, row, flush=True)
    return row


def gated_case(name, prefix, seqs, d, dev, gen, timers, *, ref=True) -> dict:
    """ops.kda_gated through CudaH200Ops (the gate from the projection's bf16 output f, dt_bias and
    A_log as the model holds them): with kda.GATE_IN_KERNEL chunk_kda computes the gate, else our
    kda_gate kernel then kda. Error against ReferenceOps.kda_gated in fp32 on the same inputs."""
    kernel_ms, _ = timers
    b, h, dk = len(seqs), d["h"], d["dk"]
    meta, slots, pool, new = _batch(b + 7, prefix, seqs, d, dev, gen, torch.float32)
    q, k, v, _, beta = _kda_inputs(sum(seqs), d, torch.bfloat16, dev, gen)
    f = torch.randn(sum(seqs), h * dk, device=dev, generator=gen).to(torch.bfloat16)
    dt_bias = 0.5 * torch.randn(h * dk, device=dev, generator=gen)
    a_log = 0.5 * torch.randn(h, device=dev, generator=gen)
    ops = CudaH200Ops()
    row = dict(case=name, kind="kda", reqs=b, tokens=sum(seqs), dtype="bfloat16", state="float32",
               gate_in_kernel=kk.gate_in_kernel(q, k, v, f, dt_bias, a_log, GATE_FLOOR, beta, pool, meta))
    if ref:
        truth_pool = pool.clone()
        truth_pool[new] = 0.0
        truth = ReferenceOps().kda_gated(q.float(), k.float(), v.float(), f.float(), dt_bias, a_log, GATE_FLOOR,
                                         beta.float(), truth_pool, meta)
        st = pool.clone()
        out = ops.kda_gated(q, k, v, f, dt_bias, a_log, GATE_FLOOR, beta, st, meta)
        used = [s for s, n in zip(slots, seqs) if n > 0]
        row.update(out_rel=_rel(out, truth), state_rel=_rel(st[used], truth_pool[used]))
        del truth_pool, truth, st, out
    t = kernel_ms(lambda: ops.kda_gated(q, k, v, f, dt_bias, a_log, GATE_FLOOR, beta, pool, meta))
    io_bytes = sum(x.numel() * x.element_size() for x in (q, k, v, f, beta)) + v.numel() * v.element_size()
    _rate(row, t, 2 * b * h * dk * d["dv"] * pool.element_size(), io_bytes)
    print(name, row, flush=True)
    return row


def conv_case(name, prefix, seqs, d, dev, gen, timers, *, dtype=torch.bfloat16, block_t=16, block_c=256,
              num_warps=4) -> dict:
    kernel_ms, ref_ms = timers
    b, c, kw = len(seqs), d["c"], d["k"]
    n_slots = 2 * b + 3
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(b + 1))[:b].tolist()
    meta = _meta(prefix, seqs, slots, dev)
    n = sum(seqs)
    x = torch.randn(n, c, device=dev, generator=gen).to(dtype)
    w = torch.randn(c, kw, device=dev, generator=gen) * 0.5
    state = torch.randn(n_slots, kw - 1, c, device=dev, generator=gen).to(dtype)
    new = [s for s, p in zip(slots, prefix) if p == 0]
    state[new] = float("nan")
    ref_state = state.float().clone()
    ref_state[new] = 0.0
    truth = ReferenceOps().causal_conv(x.float(), ref_state, w, meta)
    st = state.clone()
    out = torch.full_like(x, float("nan"))
    kconv.causal_conv(x, st, w, meta, out=out, block_t=block_t, block_c=block_c, num_warps=num_warps)
    used = slots
    row = dict(case=name, kind="conv", reqs=b, tokens=n, dtype=str(dtype)[6:], block_t=block_t, block_c=block_c,
               num_warps=num_warps,
               out_rel=_rel(out, truth), state_rel=_rel(st[used].float(), ref_state[used]))
    t = kernel_ms(lambda: kconv.causal_conv(x, state, w, meta, out=out, block_t=block_t, block_c=block_c,
                                            num_warps=num_warps))
    es = x.element_size()
    nbytes = 2 * n * c * es + b * 2 * (kw - 1) * c * state.element_size()
    row.update(us=t * 1e3, bytes=nbytes, tbps=nbytes / (t * 1e-3) / 1e12)
    row["pct_ceiling"] = 100 * row["tbps"] / CEILING_TBPS
    if dev.type == "cuda":
        rs = state.clone()
        rs[new] = 0.0
        row["ref_us"] = ref_ms(lambda: ReferenceOps().causal_conv(x, rs, w, meta)) * 1e3
        row["speedup"] = row["ref_us"] / row["us"]
    print(name, row, flush=True)
    return row


def graph_check(d, dev, gen, b) -> dict:
    """Capture one decode step (conv + KDA through CudaH200Ops) with placeholder lists, replay it
    with new slot ids, prefix lengths (some 0) and inputs, compare with the reference."""
    ops, c, kw = CudaH200Ops(), d["c"], d["k"]
    n_slots = 2 * b + 3
    x = torch.zeros(b, c, dtype=torch.bfloat16, device=dev)
    qkvgb = [torch.zeros_like(t) for t in _kda_inputs(b, d, torch.bfloat16, dev, gen)]
    slot_buf = torch.arange(b, device=dev)
    pre_buf = torch.ones(b, dtype=torch.long, device=dev)
    ar = torch.arange(b + 1, device=dev)
    meta = BatchMeta(prefix_lens=[1] * b, seq_lens=[1] * b, positions=pre_buf, req_index=ar[:b], slot_ids=slot_buf,
                     page_table=torch.zeros(b, 1, dtype=torch.long, device=dev), out_loc=ar[:b], page_size=1 << 30,
                     prefix_lens_t=pre_buf, cu_seqlens_t=ar)
    w = torch.randn(c, kw, device=dev, generator=gen) * 0.5
    conv_state = torch.zeros(n_slots, kw - 1, c, dtype=torch.bfloat16, device=dev)
    pool = torch.zeros(n_slots, d["h"], d["dk"], d["dv"], device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile outside the capture
            ops.causal_conv(x, conv_state, w, meta)
            ops.kda(*qkvgb, pool, meta)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.causal_conv(x, conv_state, w, meta)
        o = ops.kda(*qkvgb, pool, meta)
    # new step: fresh inputs, shuffled slots, some new requests, state pools random (NaN on new ones)
    slots = torch.randperm(n_slots, generator=torch.Generator().manual_seed(b))[:b].tolist()
    prefix = [0 if i % 3 == 1 else 5 + i for i in range(b)]
    x.copy_(torch.randn(b, c, device=dev, generator=gen))
    for buf, val in zip(qkvgb, _kda_inputs(b, d, torch.bfloat16, dev, gen)):
        buf.copy_(val)
    conv_state.copy_(torch.randn(conv_state.shape, device=dev, generator=gen))
    pool.copy_(_pool(n_slots, d, torch.float32, dev, gen))
    new = [s for s, p in zip(slots, prefix) if p == 0]
    conv_state[new] = float("nan")
    pool[new] = float("nan")
    slot_buf.copy_(torch.tensor(slots, device=dev))
    pre_buf.copy_(torch.tensor(prefix, device=dev))
    real = _meta(prefix, [1] * b, slots, dev)
    rc, rp = conv_state.float().clone(), pool.clone()
    rc[new] = 0.0
    rp[new] = 0.0
    y_ref = ReferenceOps().causal_conv(x.float(), rc, w, real)
    q, k, v, g, beta = qkvgb
    o_ref = ReferenceOps().kda(q.float(), k.float(), v.float(), g, beta.float(), rp, real)
    graph.replay()
    torch.cuda.synchronize(dev)
    row = dict(case=f"graph B={b}", kind="graph", reqs=b, conv_rel=_rel(y, y_ref), kda_rel=_rel(o, o_ref),
               conv_state_rel=_rel(conv_state[slots].float(), rc[slots]), state_rel=_rel(pool[slots], rp[slots]))
    row["replay_us"] = float(triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")) * 1e3
    print("graph", row, flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    p.add_argument("--no-ref", action="store_true", help="skip reference checks (times only)")
    p.add_argument("--sweep", action="store_true", help="also sweep the conv kernels' block sizes")
    p.add_argument("--decode-sweep", default="",
                   help="fixed kda.DECODE_LAUNCH shapes to time on the decode batches, BVxWARPSxSTAGES comma-separated "
                        "(e.g. 32x4x2,64x4x2,64x8x2,128x8x1); the first is fla's own")
    p.add_argument("--safe-gate", default="on",
                   help="chunk_kda's bounded-gate path for the prefill and mixed cases (kda.SAFE_GATE): "
                        "on, off, or both in turn (on,off)")
    p.add_argument("--gate-in-kernel", default="on",
                   help="ops.kda_gated on the prefill cases with the gate computed in chunk_kda "
                        "(kda.GATE_IN_KERNEL): on, off (kda_gate, then kda), or both in turn (on,off)")
    p.add_argument("--prefill-tokens", type=int, default=0, help="prefill tokens (default 8192 at full size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="decode,prefill,gated,mixed,conv,graph",
                   help="comma-separated sections: decode, prefill, gated (ops.kda_gated at prefill), mixed, conv, "
                        "graph")
    args = p.parse_args(argv)
    dev = kernel_device()
    if dev is None:
        return 2
    if dev.type == "cpu":
        kk.enable_interpreted_chunk()
    d = SMOKE if args.smoke else FULL
    timers = timing.timers(dev, host_repeats=1)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    import fla
    env = dict(torch=torch.__version__, triton=triton.__version__, fla=fla.__version__, device=str(dev),
               name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)", dims=d,
               ceiling_tbps=CEILING_TBPS)
    print("env", env, flush=True)
    rows, ref = [], not args.no_ref
    t_all = args.prefill_tokens or d["prefill_t"]

    def safe(fn, *a, **kw):
        try:
            rows.append(fn(*a, **kw))
        except Exception as e:  # a failing case is a result; keep the others
            rows.append(dict(case=a[0] if a and isinstance(a[0], str) else fn.__name__, error=f"{type(e).__name__}: "
                             f"{str(e)[:300]}"))
            print("ERROR", rows[-1], flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    only = set(args.only.split(","))
    # ---- KDA decode ----
    for b in (d["decode"] if "decode" in only else ()):
        prefix = [0 if (i % 7 == 3) else 100 + i for i in range(b)]  # a few one-token prompts ride along
        safe(kda_case, f"kda decode B={b}", prefix, [1] * b, d, dev, gen, timers, ref=ref)
    if "decode" in only:
        b = d["decode"][-1]
        safe(kda_case, f"kda decode B={b} bf16 state", [50] * b, [1] * b, d, dev, gen, timers,
             state_dtype=torch.bfloat16, ref=ref)
    for shape in filter(None, args.decode_sweep.split(",")):
        bv, warps, stages = (int(x) for x in shape.split("x"))
        saved = kk.DECODE_LAUNCH
        kk.DECODE_LAUNCH = dict(BV=bv, num_warps=warps, num_stages=stages)
        for b in d["decode"]:
            safe(kda_case, f"kda decode B={b} tile {shape}", [100] * b, [1] * b, d, dev, gen, timers, ref=ref)
        kk.DECODE_LAUNCH = saved
    for flag, values in (("--safe-gate", args.safe_gate), ("--gate-in-kernel", args.gate_in_kernel)):
        if any(v not in ("on", "off") for v in values.split(",")):
            p.error(f"{flag}: on, off or both (on,off), not {values!r}")
    for setting in args.safe_gate.split(","):
        kk.SAFE_GATE = setting == "on"
        sg = f" safe={setting}"
        # ---- KDA prefill ----
        for n in (d["prefill_splits"] if "prefill" in only else ()):
            seqs = [t_all // n] * n
            safe(kda_case, f"kda prefill {n}x{t_all // n} new{sg}", [0] * n, seqs, d, dev, gen, timers, ref=ref)
            safe(kda_case, f"kda prefill {n}x{t_all // n} hist{sg}", [300] * n, seqs, d, dev, gen, timers, ref=ref)
        if "prefill" in only:
            safe(kda_case, f"kda prefill 1x{t_all} fp32{sg}", [300], [t_all], d, dev, gen, timers,
                 dtype=torch.float32, ref=ref)
        for setting_g in (args.gate_in_kernel.split(",") if "gated" in only else ()):
            kk.GATE_IN_KERNEL = setting_g == "on"
            for n in d["prefill_splits"]:
                safe(gated_case, f"kda_gated {n}x{t_all // n} gate_in_kernel={setting_g}{sg}",
                     [0] * (n // 2) + [300] * (n - n // 2), [t_all // n] * n, d, dev, gen, timers, ref=ref)
            kk.GATE_IN_KERNEL = True
        # ---- mixed: one prefill chunk + decode rows, both strategies ----
        pt, nd = d["mixed"]
        for split in ((True, False) if "mixed" in only else ()):
            safe(kda_case, f"kda mixed {pt}+{nd}x1 split={split}{sg}", [64] + [200] * nd, [pt] + [1] * nd, d, dev,
                 gen, timers, split_decode=split, ref=ref)
    kk.SAFE_GATE = True
    # ---- conv ----
    for b in (d["decode"] if "conv" in only else ()):
        safe(conv_case, f"conv decode B={b}", [0 if i % 7 == 3 else 9 for i in range(b)], [1] * b, d, dev, gen,
             timers)
    for n in (d["prefill_splits"] if "conv" in only else ()):
        safe(conv_case, f"conv prefill {n}x{t_all // n}", [0 if i % 2 else 40 for i in range(n)],
             [t_all // n] * n, d, dev, gen, timers)
    if args.sweep:
        for bt in (8, 16, 32):
            for bc in (128, 256, 512):
                for warps in (4, 8):  # sm_90: 16 x 256 holds 168 registers a thread at 4 warps, 114 at 8
                    safe(conv_case, f"conv prefill sweep {bt}x{bc}x{warps}w", [0], [t_all], d, dev, gen, timers,
                         block_t=bt, block_c=bc, num_warps=warps)
        for bc in (128, 256, 512, 1024):
            safe(conv_case, f"conv decode sweep {bc}", [9] * d["decode"][-1], [1] * d["decode"][-1], d, dev, gen,
                 timers, block_c=bc)
    # ---- CUDA graph: one decode step captured, replayed on new values ----
    if dev.type == "cuda" and "graph" in only:
        for b in (d["decode"][1], d["decode"][-1]):
            safe(graph_check, d, dev, gen, b)

    path = write_out("kda_h200.json", dict(env=env, rows=rows))
    if path:
        print("wrote", path)
    print()
    print(f"{'case':<44} {'us':>9} {'ref_us':>10} {'TB/s':>6} {'%ceil':>6} {'out_rel':>9} {'state_rel':>9} "
          f"{'graph us':>9} {'%ceil':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<44} ERROR {r['error'][:80]}")
        elif r.get("kind") == "graph":
            print(f"{r['case']:<44} {r['replay_us']:>9.1f} {'':>10} {'':>6} {'':>6} "
                  f"{max(r['conv_rel'], r['kda_rel']):>9.2e} {max(r['conv_state_rel'], r['state_rel']):>9.2e}")
        else:
            print(f"{r['case']:<44} {r['us']:>9.1f} {r.get('ref_us', float('nan')):>10.1f} {r['tbps']:>6.2f} "
                  f"{r['pct_ceiling']:>6.1f} {r.get('out_rel', float('nan')):>9.2e} "
                  f"{r.get('state_rel', float('nan')):>9.2e} {r.get('graph_us', float('nan')):>9.1f} "
                  f"{r.get('graph_pct_ceiling', float('nan')):>6.1f}")
    bad = [r for r in rows if "error" in r or any(
        not (r.get(k, 0.0) <= (5e-3 if r.get("dtype") == "float32" and r.get("kind") == "kda" else 1e-2))
        for k in ("out_rel", "state_rel", "conv_rel", "kda_rel", "conv_state_rel") if k in r)]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} cases within bounds" + (": FAILED " + ", ".join(
        r["case"] for r in bad) if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
