"""OpenAI-style error answers: the `APIError` every route raises and its common shapes.

Rendered as `{"error": {"message", "type", "param", "code"}}`; `param` names the offending
field (`messages[2].content[0].text`, `stop`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    """An HTTP error answer in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(msg: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, msg, "invalid_request_error", param, code)


def not_supported(msg: str, param: str | None = None) -> APIError:
    """400 for a valid OpenAI feature glmrt does not implement yet."""
    return APIError(400, msg, "invalid_request_error", param, "unsupported_value")


def not_found_model(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {limit} bytes.", "invalid_request_error", None,
                    "request_too_large")


def overloaded(retry_after: float) -> APIError:
    secs = max(1, math.ceil(retry_after))
    return APIError(503, "The server is overloaded: its queues are full. Retry after a short wait.",
                    "server_error", None, "overloaded", {"Retry-After": str(secs)})


def context_length_exceeded(n: int, limit: int, param: str | None = "messages") -> APIError:
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                         f"{n} tokens. Please reduce the length of the input or of max_tokens.",
                    "invalid_request_error", param, "context_length_exceeded")


def max_tokens_beyond_context(prompt_tokens: int, max_tokens: int, limit: int, kind: str) -> str:
    """The refusal of a `max_tokens` that does not fit in the context with its prompt, in the shape
    OpenAI and vLLM answer it (code context_length_exceeded)."""
    part = "messages" if kind == "chat" else "prompt"
    return (f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {part}, {max_tokens} in the completion). "
            f"Please reduce the length of the {part} or completion.")


def internal_error(msg: str = "Internal server error.") -> APIError:
    return APIError(500, msg, "server_error", None, None)


def error_from_wire(status: int, message: str, code: str | None = None, *, prompt_param: str = "messages") -> APIError:
    """An APIError for a TokenizerError / EngineError that reached the api; `prompt_param` is the
    field a context_length_exceeded names (chat: messages, completions: prompt)."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    param = prompt_param if code == "context_length_exceeded" else None
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return APIError(status, message, kind, param, code, headers)

