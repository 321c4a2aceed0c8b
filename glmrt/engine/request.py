"""A request's engine-side state. Data only (no torch).

    all_ids = prompt_ids + output_ids
    [0, num_computed)            in the cache: KV in `pages`, state in `slot`
    [num_computed, len(all_ids)) still to compute (a decoding request has exactly one: the
                                 token it sampled last)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from glmrt.sampling_params import Grammar, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    save_at: list[int] = field(default_factory=list)   # positions whose state goes into the tree
    finish_reason: str | None = None
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    fork_parent: "Request | None" = None               # n > 1: children share the parent's prefill
    fork_children: list["Request"] = field(default_factory=list)
    admitted_once: bool = False
    mm_key_ids: list[int] | None = None   # prompt ids with image tokens replaced by content hashes
    num_tree_pages: int = 0               # full pages already offered to the prefix cache
    inflight: int = 0                     # planned or launched steps not yet applied (overlap)
    finishing: str | None = None          # finished, but a step in flight still uses its cache
    waits: list[int] = field(default_factory=list)  # host-tier load tickets its prefix waits for
    grammar: Grammar | None = None        # structured output: what its matcher enforces (a handoff sends it on)
    spec_verify_ct: int = 0               # speculative decoding: decode steps that verified its drafts

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without concatenating the whole sequence (the per-step hot path)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def key_prompt_ids(self) -> list[int]:
        """The prompt as the prefix cache sees it: placeholder tokens of different images differ."""
        return self.mm_key_ids if self.mm_key_ids is not None else self.prompt_ids

    @property
    def key_ids(self) -> list[int]:
        return self.key_prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
