"""Per-request sampling parameters: the knobs, their OpenAI/vLLM ranges, checkpoint defaults.

One type from end to end: the api builds and validates a `SamplingParams`, the wire messages
carry it as is (it is a msgspec Struct in glmrt.protocol's positional form), and the engine's
sampler reads the same object. Adding a knob means one field here plus its check in
`validate`; the api reads a field of a plain type (float, int, bool, list[int]) from the
request body by its name without further code. Data only: no torch, nothing of ours.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

# generation_config.json keys that become SamplingParams defaults (vLLM's list of sampling knobs).
_GEN_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOP_LOGPROBS = 20
MAX_N = 128
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "tool_call")


class Grammar(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A constraint on a request's answer, compiled by the engine (xgrammar) and enforced on
    every token after the think block (from the first token when the prompt closed it).

    `spec` by `kind`: json_schema, the schema as JSON text; json_object, empty (any JSON
    object); regex, the pattern the whole answer matches; ebnf, a GBNF grammar with a `root`
    rule; tool_call, `{"tools": [...], "tool_choice": "required" | {"type": "function",
    "function": {"name": N}}, "parallel_tool_calls": bool}` as JSON (a glm47 tool call whose
    arguments match the tool's parameter schema). Frozen, so it keys the compile cache.
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """How one request picks its tokens. `top_k` of -1 or 0 means off; `seed=None` is unseeded.

    Positional on the wire (see glmrt.protocol): add new fields at the end, with a default.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # read by the detokenizer only (the engine stops on token ids, never on text)
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # reasoning: after this many tokens inside the think block the engine forces `</think>`
    max_thinking_tokens: int | None = None

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature 0 or top_k 1 (no random draw, no generator consumed)."""
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (the engine's per-choice seeds, a decode's one choice)."""
        return msgspec.structs.replace(self, **changes)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError naming the first out-of-range field; return self for chaining."""
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               "temperature", f"must be a non-negative number, got {self.temperature}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
               "top_k", f"must be -1 or 0 (off) or at least 1, got {self.top_k}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1,
               "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_finite(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or null, got {self.seed!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.top_logprobs == 0 or self.logprobs,
               "top_logprobs", "requires logprobs to be true")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        for tok in self.stop_token_ids:
            in_vocab = _is_int(tok) and tok >= 0 and (vocab_size is None or tok < vocab_size)
            limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            _check(in_vocab, "stop_token_ids", f"entries must be token ids in {limit}, got {tok!r}")
        _check(self.max_thinking_tokens is None or (_is_int(self.max_thinking_tokens) and self.max_thinking_tokens >= 0),
               "max_thinking_tokens", f"must be a non-negative integer or null, got {self.max_thinking_tokens!r}")
        for text in self.stop:
            _check(isinstance(text, str) and text != "", "stop", f"entries must be non-empty strings, got {text!r}")
        return self

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Defaults from a checkpoint's generation_config.json, then the non-None `overrides`.

        Takes temperature, top_p, top_k, min_p and repetition_penalty; an explicit
        `do_sample: false` means greedy (temperature 0) unless an override sets temperature.
        """
        values: dict[str, Any] = {k: gen[k] for k in _GEN_CONFIG_KEYS if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        values.update({k: v for k, v in overrides.items() if v is not None})
        names = set(cls.__struct_fields__)
        unknown = sorted(set(values) - names)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
