"""Bounds declared with a config field, and the one check that enforces them. No torch.

    page_size: int = bounded(64, ge=1)
    \"\"\"Tokens per KV page.\"\"\"

`check_fields(obj)` checks every field of a config dataclass: its type (an int field takes
neither a str nor a bool; a float field takes an int too, and no infinity or NaN; `X | None` takes None) and its
declared bound. The first violation raises `ConfigValueError`, which keeps the field name, the
value and the requirement apart so that each caller can spell the field its own way: the
command line says `--page-size must be >= 1 (got 0)`; Python callers and topology files read
`page_size must be >= 1 (got 0)`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable


class ConfigValueError(ValueError):
    """A config value outside its declared type or bound."""

    def __init__(self, name: str, value: Any, requirement: str):
        self.name, self.value, self.requirement = name, value, requirement
        super().__init__(self.message(key_spelling))

    def message(self, spell: Callable[[str], str]) -> str:
        return f"{spell(self.name)} {self.requirement} (got {self.value!r})"


def flag_spelling(name: str) -> str:
    """`chunked_prefill_size` as the command line spells it: `--chunked-prefill-size`."""
    return "--" + name.replace("_", "-")


def key_spelling(name: str) -> str:
    """A field as a topology file spells it: the field name itself."""
    return name


@dataclass(frozen=True)
class Bound:
    """What a field's value must satisfy beyond its type (None: no such limit)."""

    ge: float | None = None
    gt: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None

    def requirement(self, value: Any) -> str | None:
        """The requirement `value` breaks, or None when it satisfies every limit."""
        if self.choices is not None and value not in self.choices:
            return "must be one of " + ", ".join(str(c) for c in self.choices)
        low = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if low and (self.lt is None or value < self.lt):
            return None
        limits = [f"{op} {x:g}" for op, x in ((">=", self.ge), (">", self.gt), ("<", self.lt)) if x is not None]
        return "must be " + " and ".join(limits)


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, lt: float | None = None,
            choices: tuple[Any, ...] | None = None) -> Any:
    """A dataclass field with a default and a declared bound."""
    return dataclasses.field(default=default, metadata={"bound": Bound(ge=ge, gt=gt, lt=lt, choices=choices)})


def _type_requirement(hint: Any, value: Any) -> str | None:
    """Why `value` does not fit the annotation `hint` (None: it fits, or the hint is not checked)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    if hint is bool and not isinstance(value, bool):
        return "must be true or false"
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if hint is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return "must be a number"
    if hint is float and not math.isfinite(value):
        return "must be a finite number"
    if hint is str and not isinstance(value, str):
        return "must be a string"
    return None


def check_fields(obj: Any) -> None:
    """Raise ConfigValueError for the first field of `obj` outside its type or declared bound."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        why = _type_requirement(hints.get(f.name), value)
        bound = f.metadata.get("bound")
        if why is None and bound is not None and value is not None:
            why = bound.requirement(value)
        if why is not None:
            raise ConfigValueError(f.name, value, why)
