"""How many GPUs this machine has, read from the device files the drivers create, and how much
host memory is available: no torch, no driver library and no child process, so `glmrt up` can
check a topology's `gpus` and host tiers against the machine before any actor starts.

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
