"""The third cache tier: a store of radix-node data behind one interface, keyed by the hash of
the token prefix it belongs to.

    NodeStore        put(key, tensors) / get(key) / contains(key) / remove(key), a byte cap, LRU
    LocalDiskStore   one safetensors file per key under a directory (--hicache-storage-dir),
                     at most --hicache-storage-size GB; least recently used files go first

Keys come from `prefix_key`: a chained SHA-256 over the token ids of each page, salted with the
cache layout, so one store directory can serve engines of different models without mixing
their rows. What the host tier stores: a page's rows of every page tensor (`page:<key>`), and
a checkpoint's slot rows plus its partial page (`ckpt:<key>`, with the tokens past its anchor).
"""

from __future__ import annotations

import abc
import collections
import hashlib
import itertools
import logging
import os
import struct
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def prefix_keys(salt: str, tokens: list[int], page_size: int, start_key: str = "") -> list[str]:
    """The chained key at the end of each full page of `tokens` (continuing from `start_key`)."""
    keys, h = [], start_key or hashlib.sha256(salt.encode()).hexdigest()
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hashlib.sha256(h.encode() + struct.pack(f"<{page_size}q", *tokens[i:i + page_size])).hexdigest()
        keys.append(h)
    return keys


def tail_key(base: str, extra: tuple[int, ...]) -> str:
    """The key of a checkpoint `extra` tokens past the page boundary whose key is `base`."""
    return hashlib.sha256(base.encode() + b"|" + struct.pack(f"<{len(extra)}q", *extra)).hexdigest()


class NodeStore(abc.ABC):
    """The interface of a third-tier store (local disk here; a remote store later)."""

    capacity_bytes: int
    counters: dict[str, int]
    on_remove = None  # called with each key the store lets go (rank 0's removals are replayed)

    @abc.abstractmethod
    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Keep `tensors` under `key`; False when it cannot (too large for the store)."""

    @abc.abstractmethod
    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The tensors stored under `key` (now the most recently used), or None."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        ...

    @abc.abstractmethod
    def remove(self, key: str) -> None:
        ...

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """Every key held, least recently used first."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        ...


class LocalDiskStore(NodeStore):
    def __init__(self, directory: str, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError("the disk tier needs a positive size")
        self.dir = os.path.abspath(os.path.expanduser(directory))
        os.makedirs(self.dir, mode=0o700, exist_ok=True)   # cached prompts' KV: this user's only
        self.capacity_bytes = capacity_bytes
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> file bytes
        self._used = 0
        self.counters = {"disk_put_bytes": 0, "disk_get_bytes": 0, "disk_evicted_files": 0}
        self._writes = itertools.count()
        # files left by an earlier run: oldest first, then trimmed to the cap
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp") or name.startswith(".tmp"):
                if _abandoned(name, path):  # a write a crash cut off: no entry, nobody's cap
                    Path(path).unlink(missing_ok=True)
            elif name.endswith(".safetensors"):
                found.append((os.path.getmtime(path), name[: -len(".safetensors")], os.path.getsize(path)))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._used += size
        self._trim(0)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".safetensors")

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: str) -> bool:
        return key in self._lru

    def keys(self) -> list[str]:
        return list(self._lru)

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Write (or refresh) one entry; False when it alone exceeds the cap or cannot be written."""
        from safetensors.torch import save

        size = sum(t.nbytes for t in tensors.values())
        if size > self.capacity_bytes:
            return False
        if key in self._lru:
            self._lru.move_to_end(key)
            return True
        self._trim(size)
        # A name of this write's own (engine replicas may share the directory), created 0600
        # before a byte is written: other local users never read a prompt's KV. The bytes are
        # written here, not by safetensors' save_file, whose own hidden temporary file a crash
        # would leave behind under a name nobody could claim.
        tmp = f"{self._path(key)}.{os.getpid()}.{next(self._writes)}.tmp"
        try:
            data = save({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()})
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self._path(key))  # a reader never sees half a file
            real = os.path.getsize(self._path(key))
        except OSError as e:  # the disk full or gone: an entry not kept, as one over the cap
            log.warning("the disk tier could not write %s: %s", key, e)
            Path(tmp).unlink(missing_ok=True)
            return False
        self._lru[key] = real
        self._used += real
        self.counters["disk_put_bytes"] += real
        self._trim(0)
        return True

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if key not in self._lru:
            return None
        try:
            out = load_file(self._path(key))
        except (OSError, ValueError, SafetensorError):   # removed or damaged under us: forget it
            self.remove(key)
            return None
        self._lru.move_to_end(key)
        self.counters["disk_get_bytes"] += self._lru[key]
        return out

    def remove(self, key: str) -> None:
        size = self._lru.pop(key, None)
        if size is None:
            return
        self._used -= size
        if self.on_remove is not None:
            self.on_remove(key)
        Path(self._path(key)).unlink(missing_ok=True)

    def _trim(self, incoming: int) -> None:
        while self._lru and self._used + incoming > self.capacity_bytes:
            key = next(iter(self._lru))
            self.remove(key)
            self.counters["disk_evicted_files"] += 1


STALE_TMP_S = 3600.0  # a temporary file no process can be named for counts as abandoned past this age


def _abandoned(name: str, path: str) -> bool:
    """Whether temporary file `name` is left by a write that will never finish: ours name their
    process (`<key>.safetensors.<pid>.<n>.tmp`) and are abandoned once it is gone; any other
    (an earlier version's, or a library's hidden one) once it is an hour old."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[-4] == "safetensors" and parts[-3].isdigit():
        pid = int(parts[-3])
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False
    try:
        return time.time() - os.path.getmtime(path) > STALE_TMP_S
    except FileNotFoundError:
        return False
