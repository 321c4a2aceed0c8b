"""Typed readers for the fields of a JSON request body (a null field means absent).

Each raises an `APIError` naming the field when the value has the wrong type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from glmrt.serving.openai_api.errors import APIError, bad_request, not_found_model

_JSON_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                    list: "an array", dict: "an object", type(None): "null"}


def json_type_name(v: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(v), type(v).__name__)


def type_error(param: str, expected: str, got: Any) -> APIError:
    return bad_request(f"Invalid type for '{param}': expected {expected}, but got {json_type_name(got)}.", param,
                       "invalid_type")


def value_error(param: str, why: str) -> APIError:
    return bad_request(f"Invalid value for '{param}': {why}", param, "invalid_value")


def read_number(body: Mapping, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise type_error(name, "a number", v)
    if not math.isfinite(v):
        raise value_error(name, "must be a finite number.")
    return v


def read_int(body: Mapping, name: str, param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    return as_int(v, param or name)


# What the wire's msgpack carries: int64 or uint64. A larger integer is refused here, not in a send.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1


def as_int(v: Any, param: str) -> int:
    if isinstance(v, bool):
        raise type_error(param, "an integer", v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise type_error(param, "an integer", v)
    if not INT_MIN <= v <= INT_MAX:
        raise value_error(param, f"must fit in 64 bits, got {v}.")
    return v


def _read_typed(body: Mapping, name: str, kind: type, expected: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, kind):
        raise type_error(name, expected, v)
    return v


def read_bool(body: Mapping, name: str) -> bool | None:
    return _read_typed(body, name, bool, "a boolean")


def read_str(body: Mapping, name: str) -> str | None:
    return _read_typed(body, name, str, "a string")


def read_object(body: Mapping, name: str) -> dict | None:
    return _read_typed(body, name, dict, "an object")


def decode_body(body: bytes | str) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.", None, "invalid_json") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.", None, "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"The request body must be a JSON object, got {json_type_name(obj)}.", None, "invalid_json")
    return obj


def check_model(body: Mapping, served_model: str | Iterable[str]) -> str:
    names = [served_model] if isinstance(served_model, str) else list(served_model)
    model = read_str(body, "model")
    if model is None:  # lenient (like vLLM): no model means the served one
        return names[0]
    if model not in names:
        raise not_found_model(model)
    return model



def read_float(body: Mapping, name: str) -> float | None:
    v = read_number(body, name)
    return None if v is None else float(v)


def token_ids(values: list, param: str) -> list[int]:
    """Non-negative integer token ids; a bad entry is named `param[i]`."""
    out = []
    for i, x in enumerate(values):
        x = as_int(x, f"{param}[{i}]")
        if x < 0:
            raise value_error(f"{param}[{i}]", f"token ids are non-negative, got {x}.")
        out.append(x)
    return out


# Longest array a token-id field of the request (stop_token_ids) may hold: the engine scans it per token.
MAX_TOKEN_ID_FIELD = 1024


def read_token_ids(body: Mapping, name: str) -> list[int] | None:
    """An optional array of token ids; an empty one means absent."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list):
        raise type_error(name, "an array of integers", v)
    if len(v) > MAX_TOKEN_ID_FIELD:
        raise value_error(name, f"at most {MAX_TOKEN_ID_FIELD} token ids are allowed, got {len(v)}.")
    return token_ids(v, name) or None
