"""Which Triton kernels compiled during an engine step, for the slow-step log.

A kernel variant compiled mid-traffic stalls every running request for the compile (seconds);
the start-up warm-up exists to run them all first. When a step is slow anyway, the log names
the kernels that compiled in it (with their specialisation), so the missing warm-up shape can
be found from one serving run. Triton's `knobs.runtime.jit_post_compile_hook` is called after
every compile (on-disk cache hits included, which take milliseconds); installed only in the
engine process, only on CUDA (Triton is not imported anywhere else).
"""

from __future__ import annotations

_compiled: list[str] = []
_installed = False


def install() -> bool:
    """Start recording compiles (idempotent) -> whether Triton's hook is available."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
        runtime = knobs.runtime
        prev = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def hook(*args, **kwargs):
        info = kwargs.get("fn")
        name = getattr(info, "name", None) or "kernel"
        _compiled.append(f"{name.rsplit('.', 1)[-1]}: {kwargs.get('repr', '')}")
        return prev(*args, **kwargs) if prev is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def take() -> list[str]:
    """The compiles recorded since the last call (and forget them)."""
    out = list(_compiled)
    _compiled.clear()
    return out


def summary(compiled: list[str], width: int = 1500) -> str:
    """A log fragment: how many kernels compiled, by name with counts (an autotuned kernel
    compiles once per config), and the first one's specialisation (its signature's argument
    types and constexpr values tell which launch argument was new), cut to `width`."""
    if not compiled:
        return "no Triton kernel compiled in it"
    counts: dict[str, int] = {}
    for c in compiled:
        name = c.split(":", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    names = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in counts.items())
    return f"{len(compiled)} Triton kernels compiled in it ({names}); the first: {compiled[0][:width]}"
