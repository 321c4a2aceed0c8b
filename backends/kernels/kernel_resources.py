"""Registers, stack and shared memory of every kernel specialisation an interpreted run launched,
compiled for a GPU; no GPU needed.

    python3 -m backends.kernels.kernel_resources [--target sm90] [--match NAME] -- PYTEST_ARGS...

The same recording as compile_check (the pytest command runs with the interpreter and a recorder
on), then each distinct specialisation is compiled in a child interpreter and its cubin read with
the `cuobjdump` Triton bundles. One line per specialisation: the kernel, its tile constexprs and
launch options, registers a thread, stack bytes a thread (a stack frame: ptxas spilled, or keeps
an array in local memory), shared memory a block, and how many blocks an SM holds by registers
and by shared memory. The constexprs are the launch's own: a test on a K that is not a multiple
of the tile compiles the masked variant (EVEN_K and the like), not the model's. A tile that
spills, or one that leaves an SM one block where a smaller one gets two, shows here before any GPU
time is spent on it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from .compile_check import (compile_parallel, jit_of_record, read_records, record_launches, source_of, variants,
                            _TARGETS)

# per SM: 32-bit registers, shared memory a block may have and the SM holds, threads
_LIMITS = {"sm90": (65536, 227 * 1024, 228 * 1024, 2048), "sm100": (65536, 227 * 1024, 228 * 1024, 2048)}


def resources_one(rec: dict, target: str) -> dict:
    """Compile one record as launched; {"regs", "stack", "shared", "warps", "stages"} or {"error"}."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        jit = jit_of_record(rec)
        _, constexprs, options = variants(rec, jit.arg_names)[0]  # as launched, INTERPRET off
        kernel = triton.compile(source_of(rec, jit, constexprs), target=GPUTarget(*_TARGETS[target]), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
    except Exception as e:  # noqa: BLE001 - a record that does not compile is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    field = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))  # noqa: E731
    return {"regs": field("REG"), "stack": field("STACK"), "shared": int(kernel.metadata.shared),
            "warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages}


def resources_of(recs: list[dict], target: str, jobs: int = 2) -> list[dict]:
    """resources_one of each record, in compile_check's child interpreters (`jobs` at once)."""
    with tempfile.TemporaryDirectory(prefix="glmrt-resources-", ignore_cleanup_errors=True) as tmp:
        results = compile_parallel(recs, target, tmp, jobs, fn="backends.kernels.kernel_resources:resources_one")
    return [r if isinstance(r, dict) else {"error": str(r)} for r in results]  # a child that died: its message


def tile_of(rec: dict) -> str:
    """The record's upper-case constexprs that are ints, bools or short strings (tile sizes,
    switches, a product's precision) as NAME=value, in argument order; PDL and INTERPRET (compiled
    off) left out."""
    names = rec.get("arg_names")
    out = []
    for (path, v) in rec["constexprs"]:
        name = names[path[0]] if names else str(path[0])
        if (name.isupper() and name not in ("PDL", "INTERPRET")
                and (isinstance(v, (bool, int)) or (isinstance(v, str) and len(v) <= 12))):
            out.append(f"{name}={int(v) if isinstance(v, bool) else v}")
    return " ".join(out)


def blocks_per_sm(res: dict, target: str) -> tuple[int, int]:
    """Blocks an SM can hold by its registers and by its shared memory, as the occupancy
    calculator counts them: registers are allocated per warp in units of 256 from each quarter
    of the SM's file, at most 32 blocks and the SM's threads; shared memory with 1 KB reserved a
    block, none past the per-block limit."""
    regs, per_block_smem, sm_smem, threads = _LIMITS[target]
    per_warp = -(-res["regs"] * 32 // 256) * 256
    warps_by_regs = 4 * (regs // 4 // per_warp)
    cap = min(32, threads // (32 * res["warps"]))
    by_regs = min(warps_by_regs // res["warps"], cap)
    if res["shared"] > per_block_smem:
        return by_regs, 0
    by_smem = min(sm_smem // (res["shared"] + 1024), cap) if res["shared"] else cap
    return by_regs, by_smem


def table(recs: list[dict], results: list[dict], target: str) -> str:
    lines = [f"{'kernel':<32} {'warps':>5} {'stages':>6} {'regs':>4} {'stack':>5} {'shared':>7} {'blocks/SM regs,smem':>19}  tile"]
    for rec, res in sorted(zip(recs, results), key=lambda x: (x[0]["name"], tile_of(x[0]))):
        if "error" in res:
            lines.append(f"{rec['name']:<32} error: {res['error']}")
            continue
        by_regs, by_smem = blocks_per_sm(res, target)
        lines.append(f"{rec['name']:<32} {res['warps']:>5} {res['stages']:>6} {res['regs']:>4} {res['stack']:>5} "
                     f"{res['shared']:>7} {f'{by_regs},{by_smem}':>19}  {tile_of(rec)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m backends.kernels.kernel_resources",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", default="sm90", choices=sorted(_LIMITS))
    p.add_argument("--jobs", type=int, default=2, help="child compilers at once")
    p.add_argument("--match", default="", help="only kernels whose name contains this")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest command's arguments")
    args = p.parse_args(argv)
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.jsonl")
        rc = record_launches(pytest_args, path)
        recs = [r for r in (read_records(path) if os.path.exists(path) else [])
                if args.match in r["name"] and "error" not in r]
    results = resources_of(recs, args.target, args.jobs)
    for rec in recs:  # the argument names, for the tile column
        rec["arg_names"] = jit_of_record(rec).arg_names
    print(table(recs, results, args.target))
    return 1 if rc != 0 or not recs or any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
