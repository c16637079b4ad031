"""Reading a request within the limits, and writing the router's own small answers."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nomad_driver.safeload import LoadError, json_loads
from router import errors
from router.config import Limits
from router.errors import RouterError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JSON = (b"content-type", b"application/json")
# Bodies past this are parsed on a worker thread. The bounded reader takes about 0.6 s on a
# max-size body of token IDs, and on the event loop every other client waited that long. Its
# number hooks are Python calls, so the parsing thread hands the interpreter back to the loop
# every few milliseconds (sys.getswitchinterval). A chat request is a few KiB and stays inline.
OFF_LOOP_BYTES = 256 * 1024
# Two at once: more would only share the same interpreter lock, and the queue behind them is
# bounded by the connection cap and the body limit.
_parsers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmgw-parse")


class ClientGone(Exception):
    """The client hung up before its request was read."""


def read_headers(scope: Scope, limits: Limits) -> tuple[bytes | None, bytes | None]:
    """The authorization and session headers, once the limits are checked; a body announced
    as too large is refused before a byte of it is read."""
    headers = scope["headers"]
    if len(headers) > limits.max_headers:
        raise RouterError(431, "headers_too_large", f"{len(headers)} headers; at most {limits.max_headers}")
    auth = session = length = None
    total = 0
    for name, value in headers:
        total += len(name) + len(value)
        if name == b"authorization":
            auth = value
        elif name == b"x-llmgw-session":
            session = value
        elif name == b"content-length":
            length = value
    if total > limits.max_header_bytes:
        raise RouterError(
            431, "headers_too_large", f"{total} bytes of headers; at most {limits.max_header_bytes}"
        )
    if length is not None:
        try:
            size = int(length)
        except ValueError:
            raise errors.bad_request(f"Content-Length {length!r} is not a number") from None
        if size > limits.max_body_bytes:
            raise too_large(size, limits.max_body_bytes)
    return auth, session


async def read_body(receive: Receive, limit: int, timeout_s: float = 30.0, total_s: float = 60.0) -> bytes:
    """The request body, each read within `timeout_s` and the whole within `total_s`."""
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_s
    while True:
        left = deadline - loop.time()
        try:
            async with asyncio.timeout(min(timeout_s, left)):
                message = await receive()
        except TimeoutError:
            if timeout_s < left:
                raise body_timeout(f"nothing for {timeout_s:g}s after {size} bytes") from None
            raise body_timeout(f"{size} bytes so far", total_s) from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# While a parse runs on a worker, the interpreter changes threads every millisecond instead of
# every five: a small request needs the loop several times (read, send upstream, relay), and at
# five milliseconds a wait each a concurrent parse still added tens of milliseconds to it.
PARSING_SWITCH_INTERVAL_S = 0.001
_parsing = 0
_switch_interval_s = sys.getswitchinterval()


async def parse_request_off_loop(body: bytes) -> dict[str, Any]:
    """`parse_request`, on a worker thread for a big body."""
    global _parsing, _switch_interval_s
    if len(body) < OFF_LOOP_BYTES:
        return parse_request(body)
    if _parsing == 0:
        _switch_interval_s = sys.getswitchinterval()
        sys.setswitchinterval(min(_switch_interval_s, PARSING_SWITCH_INTERVAL_S))
    _parsing += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_parsers, parse_request, body)
    finally:
        _parsing -= 1
        if _parsing == 0:
            sys.setswitchinterval(_switch_interval_s)


def parse_request(body: bytes) -> dict[str, Any]:
    if not body:
        raise errors.bad_request("the request body is empty; expected a JSON object with a 'model' field")
    try:
        # Bounded: a 2 KB body of nested brackets is a 400 like any other bad JSON, never a 500
        # with a traceback that the SDKs would retry.
        request = json_loads(body, "the request body")
    except LoadError as exc:
        raise errors.bad_request(f"the request body is {exc.detail}", code="invalid_json") from None
    if not isinstance(request, dict):
        raise errors.bad_request(
            f"the request body must be a JSON object, not a {type(request).__name__}", code="invalid_json"
        )
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request(
            "'model' is required: the name of the model to use, as listed by GET /v1/models",
            code="missing_model",
            param="model",
        )
    return request


def body_timeout(detail: str, total_s: float | None = None) -> RouterError:
    # Connection: close, so that the rest of a slow body does not keep the connection (and
    # its file descriptor) open after the answer.
    what = (
        f"the request body did not arrive within {total_s:g}s ({detail})"
        if total_s is not None
        else f"the request body stopped arriving: {detail}"
    )
    return RouterError(
        408,
        "request_timeout",
        f"{what}; send the whole body at once",
        headers=((b"connection", b"close"),),
    )


def too_large(size: int, limit: int) -> RouterError:
    # 413, which says what 400 does not: the body, not its content, is the problem. The SDKs do
    # not retry a 413; the header says so to any client that would.
    return RouterError(
        413,
        "request_too_large",
        f"the request body is {size} bytes; the router accepts at most {limit} bytes",
        headers=errors.NO_RETRY,
    )


async def send_bytes(send: Send, status: int, payload: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def send_json(send: Send, status: int, body: Any) -> None:
    await send_bytes(send, status, json.dumps(body).encode(), [JSON])


async def send_error(send: Send, err: RouterError) -> None:
    await send_bytes(send, err.status, err.body(), [JSON, *err.headers])
