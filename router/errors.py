"""Errors in OpenAI's shape, so every client library shows the router's reason as its own.

`{"error": {"message", "type", "param", "code"}}`: the official SDKs put `message` in the
exception text and the whole object in `.body`, so `code` is what a program branches on and
`message` is what a person reads. Each error says what failed, for which model, and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from nomad_driver.redaction import redact

# The SDKs retry 408, 409, 429 and 5xx unless told not to; a refusal that will give the same
# answer on every retry must say so, or a client retries it forever (the phi-4 incident).
NO_RETRY: tuple[tuple[bytes, bytes], ...] = ((b"x-should-retry", b"false"),)


class RouterError(Exception):
    """An answer the router gives instead of a replica's."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type_
        self.param = param
        self.headers = tuple(headers)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def sse_frame(self) -> bytes:
        """The same error as one server-sent event, for a stream that already started: the
        SDKs raise on a `data:` frame whose object has an `error` key."""
        return b"data: " + self.body() + b"\n\n"


def keepalive(model: str) -> bytes:
    """An SSE comment: clients and proxies see bytes flowing, and the SDKs skip it."""
    return f": waiting for a replica of {model}\n\n".encode()


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    # Redacted for every answer the router writes itself: its messages quote what engines and
    # Nomad said, and they quote what they were given (a source, a header).
    error = {"message": redact(message), "type": type_, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def redacted(payload: bytes) -> bytes:
    """An engine's own error answer, as it sent it but for anything credential-shaped: masked
    as `redact` masks it, which keeps JSON valid JSON."""
    text = payload.decode("utf-8", "replace")
    masked = redact(text)
    return payload if masked == text else masked.encode()


def engine_error_frame(error: dict[str, Any]) -> bytes:
    """The engine's own error object as one server-sent event, redacted."""
    return b"data: " + redacted(json.dumps({"error": error}).encode()) + b"\n\n"


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> RouterError:
    return RouterError(400, code, message, param=param)


def unauthorized(message: str) -> RouterError:
    return RouterError(
        401,
        "invalid_api_key",
        message,
        type_="authentication_error",
        headers=((b"www-authenticate", b'Bearer realm="llmgw"'),),
    )


def model_not_found(model: str, known: Iterable[str]) -> RouterError:
    names = sorted(known)
    listed = ", ".join(names) if names else "none are defined"
    return RouterError(
        404,
        "model_not_found",
        f"model '{model}' does not exist; known models: {listed}",
        param="model",
    )


def parked(model: str, failures: int, last_error: str) -> RouterError:
    reason = redact(last_error) or "no error was recorded"
    return RouterError(
        503,
        "model_parked",
        f"model '{model}' is parked after {failures} consecutive start failures: {reason}; "
        f"fix the source or profile, or run 'llmgw ctl retry {model}'",
        type_="model_unavailable",
        headers=NO_RETRY,
    )


def unplaceable(model: str, reason: str) -> RouterError:
    why = redact(reason) or "Nomad found no node for it"
    return RouterError(
        503,
        "model_unplaceable",
        f"model '{model}' cannot be placed on any node: {why}; free capacity (stop or scale down "
        "other models, add nodes) or change its profile, then ask again",
        type_="model_unavailable",
        headers=NO_RETRY,
    )


def loading(model: str, waited_s: float, retry_after_s: int) -> RouterError:
    return RouterError(
        503,
        "model_loading",
        f"model '{model}' was placed but no replica became ready within {waited_s:.0f}s; "
        f"it is still starting, retry in {retry_after_s}s",
        type_="model_unavailable",
        headers=((b"retry-after", str(retry_after_s).encode()),),
    )


def overloaded(model: str, waiting: int, retry_after_s: int) -> RouterError:
    # 429, not 503: the model is coming, there is just no room in the queue for it yet. Not
    # retried by the SDK: its two quick retries would land on the same full queue (a cold start
    # takes minutes) and triple the arrivals at it; the caller gets RateLimitError at once, with
    # Retry-After for its own back-off.
    return RouterError(
        429,
        "model_overloaded",
        f"model '{model}' has no ready replica and {waiting} requests already wait for one; "
        f"retry in {retry_after_s}s",
        type_="rate_limit_error",
        headers=((b"retry-after", str(retry_after_s).encode()), *NO_RETRY),
    )


def removed(model: str) -> RouterError:
    return RouterError(
        404,
        "model_not_found",
        f"model '{model}' was removed from the definitions while this request waited for it",
        param="model",
        headers=NO_RETRY,
    )


# An activation nobody answered is worth asking again soon: a watcher takes over within seconds.
RETRY_ACTIVATION = ((b"retry-after", b"5"),)


def activation_failed(model: str, why: str) -> RouterError:
    """No ready replica, and the ask for one got no answer it can act on: no watcher answered
    within the window (none leads, or it cannot reach Nomad), or Nomad refused the scale."""
    return RouterError(
        503,
        "activation_failed",
        f"model '{model}' has no ready replica and starting one failed: {redact(why)}; retry shortly",
        type_="server_error",
        headers=RETRY_ACTIVATION,
    )
