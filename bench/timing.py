"""How the GPU benches time things: `do_bench` medians for kernels, event-timed
medians for slow reference calls, CUDA-graph replays for chains of small launches."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def timers(dev: torch.device, host_repeats: int = 3) -> tuple[Callable, Callable]:
    """-> (kernel_ms, ref_ms). On CUDA: triton's do_bench median (L2 flushed) and the median of
    n event-timed calls after one warm-up; elsewhere (the interpreter) host-clock medians."""
    if dev.type == "cuda":
        import triton

        def kernel_ms(fn):
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

        return kernel_ms, event_ms

    def host_ms(fn, n=host_repeats):
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return host_ms, host_ms


def event_ms(fn: Callable, n: int = 3) -> float:
    """Median event-timed call of fn on the current CUDA stream, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def replay_ms(graph: torch.cuda.CUDAGraph, n: int = 20, warm_s: float = 0.0) -> float:
    """Median event-timed replay of a captured graph, after 3 warm replays, or after replaying it
    back to back for warm_s seconds (a GPU fresh from idle may not be at its working clocks yet)."""
    t0 = time.perf_counter()
    k = 0
    while k < 3 or time.perf_counter() - t0 < warm_s:
        graph.replay()
        k += 1
        if k % 16 == 0:
            torch.cuda.synchronize()  # the clock above measures the GPU's time, not the queue's
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn: Callable, n: int = 30) -> float:
    """Capture fn (after two eager warm-ups on a side stream) and time its replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return replay_ms(g, n)


def kernel_us(prof) -> dict[str, float]:
    """Device µs per kernel name over a torch.profiler region (CUDA activity), largest first."""
    acc: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name] = acc.get(e.name, 0.0) + e.device_time
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


_HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_events(fn: Callable, reps: int = 1, host: bool = False) -> dict:
    """fn once to warm, then `reps` calls under torch.profiler -> per call: "kernels" (name ->
    (device µs, launches), most time first), "kernel_us" and "launches" (their totals); with
    host=True also "syncs" (the host waiting for the GPU: stream, device and event syncs) and
    "h2d_copies" (copies from pageable host memory, each of which waits for the queue to drain)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us, count = kernel_us(prof), {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] = count.get(e.name, 0) + 1
    out = {"kernels": {k: (t / reps, count[k] / reps) for k, t in us.items()},
           "kernel_us": sum(us.values()) / reps, "launches": sum(count.values()) / reps}
    if host:
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
        out["syncs"] = sum(n in _HOST_WAITS for n in names) / reps
        out["h2d_copies"] = sum(c for n, c in count.items() if n.startswith("Memcpy HtoD (Pageable")) / reps
    return out


def wait_sites(fn: Callable, roots: tuple[str, ...] = ("glmrt", "backends", "fla", "bench")) -> dict[str, int]:
    """Where one call of fn makes the host wait for the GPU: torch's sync debug mode warns at each
    synchronizing call (a stream sync, an `.item()`, a copy to or from pageable memory); each is
    counted at the two innermost Python frames under `roots` ("path:line function < its caller")."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(f"/{r}/" in f.filename for r in roots) and "/bench/timing.py" not in f.filename]
        key = " < ".join(f"{_short(f.filename, roots)}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))
        sites[key] = sites.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def _short(path: str, roots: tuple[str, ...]) -> str:
    """path from the root that appears last in it (".../torch/.venv/.../triton/jit.py" -> "triton/jit.py")."""
    at = max(((path.rfind(f"/{r}/"), r) for r in roots), default=(-1, ""))
    return path if at[0] < 0 else path[at[0] + 1:]


def host_profile(fn: Callable, top: int = 25,
                 roots: tuple[str, ...] = ("glmrt", "backends", "fla", "torch", "triton")) -> list[tuple]:
    """One call of fn under cProfile (the GPU synced before and after) -> its `top` functions by
    own host time: (own ms, cumulative ms, calls, "path:line function")."""
    import cProfile
    import pstats

    _sync()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    _sync()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = [(tt * 1e3, ct * 1e3, nc, f"{_short(path, roots)}:{line} {name}")
            for (path, line, name), (cc, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[0])[:top]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_time(fn: Callable, n: int = 4, top: int = 0) -> dict:
    """Where a step's host time goes: fn once to warm, then n calls, each timed twice on the host
    clock: when fn returns ("host_ms", the host's own work plus any wait inside fn) and when the
    GPU has finished it too ("wall_ms"); medians. With `top`, one more call's host_profile ("top").
    Work the host does before a step's first launch (its metadata, say) leaves the GPU idle: it
    shows as a wall time above the kernels' sum, and in "top"."""
    fn()
    _sync()
    host, wall = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        _sync()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
            "top": host_profile(fn, top) if top else []}


def as_engine_threads() -> int:
    """Give this process's torch CPU ops as many threads as an engine actor has
    (EngineActorConfig.torch_threads) -> that number. A bench that times whole steps on the host
    clock then times the host work before a step's first launch (its batch metadata) as serving
    does it: with a thread per core, that work's index ops fan out over every core, and each op
    waits for a core another process holds (~20 ms spikes on a 2-core host with one core busy,
    against 0.5 ms on one thread)."""
    from glmrt.actor_config import EngineActorConfig

    n = EngineActorConfig.torch_threads  # the dataclass field's default
    torch.set_num_threads(n)
    return n
