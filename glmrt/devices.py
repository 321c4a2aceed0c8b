"""How many GPUs this machine has, read from the device files the drivers create, and how much
host memory is available, and how much GPU memory is free: no torch and no driver library (the
free GPU memory asks nvidia-smi), so `glmrt up` can check a topology's `gpus`, host tiers and
memory fit against the machine before any actor starts.

NVIDIA: one /dev/nvidiaN per GPU. AMD (ROCm): one KFD topology node per GPU, those with a
non-zero gpu_id (the CPU nodes have 0). Indices are the machine's, before any
CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES remapping, as a topology's `gpus` are.
"""

from __future__ import annotations

import glob
import os
import re

_NVIDIA = re.compile(r"nvidia(\d+)$")


def gpu_count(dev: str = "/dev", kfd_nodes: str = "/sys/class/kfd/kfd/topology/nodes") -> int:
    nvidia = [n for n in os.listdir(dev) if _NVIDIA.match(n)] if os.path.isdir(dev) else []
    amd = 0
    for path in glob.glob(os.path.join(kfd_nodes, "*", "gpu_id")):
        try:
            with open(path, encoding="ascii") as f:
                amd += int(f.read().strip() or 0) != 0
        except (OSError, ValueError):
            continue
    return len(nvidia) + amd


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The kernel's estimate of memory available to new allocations (MemAvailable)."""
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def gpu_free_bytes(indices: list[int], drm: str = "/sys/class/drm") -> dict[int, int] | None:
    """Free memory of the machine's GPUs `indices` (machine indices, as `gpu_count`), or None when
    it cannot be read. NVIDIA: `nvidia-smi --query-gpu` (a child process, no CUDA context in this
    one); AMD: the amdgpu driver's mem_info_vram_total / _used files. Read before any actor
    starts, so no memory of this deployment is in use yet."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        free = {int(i): int(float(mib)) * 2**20 for i, mib in (line.split(",") for line in out.strip().splitlines())}
    except (OSError, subprocess.SubprocessError, ValueError):
        free = {}
        cards = sorted(glob.glob(os.path.join(drm, "card[0-9]*", "device", "mem_info_vram_total")))
        for i, path in enumerate(cards):
            try:
                with open(path, encoding="ascii") as f:
                    total = int(f.read())
                with open(path.replace("_total", "_used"), encoding="ascii") as f:
                    free[i] = total - int(f.read())
            except (OSError, ValueError):
                return None
    if not all(i in free for i in indices):
        return None
    return {i: free[i] for i in indices}
