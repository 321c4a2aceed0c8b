"""How many images and videos one chat request may carry (`--limit-mm-per-prompt`, vLLM's flag).

Each item is fetched or decoded and preprocessed by a tokenizer before the prompt's length is
known, so a request of thousands of tiny images would hold a tokenizer (and the requests behind
it) for as long as they take. The API counts the parts and refuses a request over the limit
before any is opened. No torch: the api process reads this.
"""

from __future__ import annotations

import json
from typing import Any

MM_KINDS = ("image", "video")
DEFAULT_LIMITS = '{"image": 32, "video": 4}'


def parse_mm_limits(value: Any) -> dict[str, int]:
    """`{"image": N, "video": M}` as JSON text (or a table already parsed) -> the limit of each
    kind; a kind left out keeps its default. ValueError, one line, for anything else."""
    text = value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"must be a JSON object such as {DEFAULT_LIMITS} (got {text!r})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object such as {DEFAULT_LIMITS} (got {text!r})")
    limits = dict(json.loads(DEFAULT_LIMITS))
    for kind, n in value.items():
        if kind not in MM_KINDS:
            raise ValueError(f"has no kind {kind!r} (known: {', '.join(MM_KINDS)})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{kind} must be an integer >= 0 (got {n!r})")
        limits[kind] = n
    return limits
