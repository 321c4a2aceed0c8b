"""Carve one cache budget into the two pools and derive the running-request limit. No torch.

    state : KV = r : 1   (--mamba-full-memory-ratio r)   =>  state gets r / (1 + r) of the budget
    or --max-mamba-cache-size S pins the slot count: state = S slots, KV = the rest.
Each running request needs its live slot plus `checkpoint_headroom` slots for the prefix
cache's state checkpoints, so max_running_requests <= slots / (1 + headroom). Speculative
decoding reserves one more slot per running request out of the same state budget (`rollback`):
a verify step snapshots each drafting request's state there and rolls back to it when the model
rejects a draft, so the state slots then split into managed slots and that reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmrt.cache.layout import CacheLayout

DEFAULT_MAX_RUNNING = 256


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    kv_bytes: int
    state_bytes: int
    num_pages: int
    num_slots: int
    page_size: int
    max_running_requests: int
    clamp_reason: str | None
    rollback_slots: int = 0          # speculative decoding: one snapshot slot per running request
    rollback_bytes: int = 0
    draft_kv_bytes_per_token: float = 0.0  # the MTP draft layer's share of the KV pool

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "kv_pool_bytes": self.kv_bytes, "kv_pool_pages": self.num_pages,
                "kv_pool_tokens": self.kv_tokens, "page_size": self.page_size, "state_pool_bytes": self.state_bytes,
                "state_pool_slots": self.num_slots, "max_running_requests": self.max_running_requests,
                "max_running_requests_clamp": self.clamp_reason, "rollback_slots": self.rollback_slots,
                "rollback_bytes": self.rollback_bytes}

    def describe(self) -> str:
        gib = 2**30
        lines = [
            f"KV pool: {self.kv_bytes / gib:.3f} GiB, {self.num_pages} pages x {self.page_size} = {self.kv_tokens} tokens",
            f"state pool: {self.state_bytes / gib:.3f} GiB, {self.num_slots} slots",
            f"max_running_requests: {self.max_running_requests}"
            + (f" (clamped: {self.clamp_reason})" if self.clamp_reason else ""),
        ]
        if self.rollback_slots:
            draft = self.draft_kv_bytes_per_token * self.kv_tokens
            lines.append(f"speculative decoding: draft KV (the MTP layer's latent and pooled keys, in the KV pool) "
                         f"{draft / gib:.3f} GiB ({self.draft_kv_bytes_per_token:.0f} B per token); rollback "
                         f"reserve {self.rollback_bytes / gib:.3f} GiB, {self.rollback_slots} state slots "
                         "(one snapshot per running request)")
        return "\n".join(lines)


def plan_memory(layout: CacheLayout, budget_bytes: int, *, ratio: float = 0.9,
                max_mamba_cache_size: int | None = None, max_running_requests: int | None = None,
                checkpoint_headroom: int = 1, rollback: bool = False,
                draft_kv_bytes_per_token: float = 0.0) -> MemoryPlan:
    if budget_bytes <= 0:
        raise ValueError("the cache budget must be positive")
    per_slot = layout.state_bytes_per_slot
    per_page = layout.kv_bytes_per_page
    if max_mamba_cache_size is not None:  # ratio and size meet EngineConfig's declared bounds
        state = max_mamba_cache_size * per_slot
        if state >= budget_bytes:
            raise ValueError(f"--max-mamba-cache-size {max_mamba_cache_size} needs {state / 2**30:.2f} GiB of state, "
                             f"more than the whole cache budget ({budget_bytes / 2**30:.2f} GiB)")
    else:
        state = int(budget_bytes * ratio / (1 + ratio))
    slots = state // per_slot
    pages = (budget_bytes - slots * per_slot) // per_page
    if slots < 1 or pages < 1:
        raise ValueError(f"cache budget {budget_bytes / 2**20:.1f} MiB is too small: one state slot needs "
                         f"{per_slot / 2**20:.2f} MiB and one KV page {per_page / 2**20:.3f} MiB")
    per_req = 1 + checkpoint_headroom + (1 if rollback else 0)
    if rollback and slots < per_req:
        raise ValueError(f"cache budget {budget_bytes / 2**20:.1f} MiB is too small: a request needs {per_req} state "
                         f"slots of {per_slot / 2**20:.2f} MiB (live, checkpoint headroom, rollback snapshot)")
    bound = max(1, slots // per_req)
    wanted = max_running_requests if max_running_requests is not None else DEFAULT_MAX_RUNNING
    reason = None
    if wanted > bound:
        reason = (f"{slots} state slots / (1 live + {checkpoint_headroom} checkpoint headroom"
                  + (" + 1 rollback snapshot" if rollback else "") + f" per request) = {bound}")
    running = min(wanted, bound)
    reserve = running if rollback else 0
    return MemoryPlan(budget_bytes, int(pages * per_page), int((slots - reserve) * per_slot), int(pages),
                      int(slots - reserve), layout.page_size, running, reason, reserve, int(reserve * per_slot),
                      draft_kv_bytes_per_token)


def draft_kv_bytes(text, *, kv_dtype: str, model_dtype: str, tp_size: int = 1) -> float:
    """KV bytes per token the MTP draft layer adds to the pool (its latent row and pooled-key share)."""
    kw = dict(kv_dtype=kv_dtype, model_dtype=model_dtype, tp_size=tp_size, page_size=text.index_kpool)
    return (CacheLayout.from_config(text, with_mtp=True, **kw).kv_bytes_per_token
            - CacheLayout.from_config(text, **kw).kv_bytes_per_token)


def balanced_ratio(layout: CacheLayout, mean_request_tokens: float) -> float:
    """The r that gives the KV pool exactly the tokens its slots' requests need on average.

    Balanced when slots * mean_len tokens of KV exist for the slots:  KV/state bytes =
    mean_len * kv_bytes_per_token / state_bytes_per_slot, so r = state/KV is the inverse.
    """
    return layout.state_bytes_per_slot / (mean_request_tokens * layout.kv_bytes_per_token)
