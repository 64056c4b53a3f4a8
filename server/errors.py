"""API errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with their HTTP status."""
from __future__ import annotations

from typing import Any

from aiohttp import web

_ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error the client is told about; `param` names the offending request field, if any."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def invalid_type(param: str, expected: str, value: Any) -> ApiError:
    return bad_request(f"'{param}' must be {expected}, got {json_type(value)}.", param, "invalid_type")


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    names = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/responses/{id}",
          "DELETE /v1/responses/{id}", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/embeddings",
          "GET /v1/models", "GET /v1/models/{id}", "POST /tokenize", "POST /detokenize", "GET /health", "GET /metrics",
          "GET /status")


def from_http_exception(exc: web.HTTPException, method: str = "", path: str = "") -> ApiError:
    """aiohttp's own 404 / 405 / 413 as OpenAI-shaped errors, with a sentence saying what exists."""
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    message = exc.reason
    if exc.status == 404:
        message = f"there is no route {method} {path} on this server; it serves {', '.join(ROUTES)}."
    elif exc.status == 405 and headers:
        message = f"{path} does not take {method}; it takes {headers['Allow']}."
    return ApiError(exc.status, message, None, codes.get(exc.status), headers)


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)
