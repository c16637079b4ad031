"""The upstream half of the request path: one aiohttp session with a keep-alive pool to every
replica, and the relay that passes a replica's answer back to the client as it arrives.

Failures are sorted by what the client has seen. Before the replica answered anything the
request can go to another replica and the client never knows (`ConnectFailed`). Once a stream
is flowing, the client gets the events that arrived whole and then one error event, so the SDK
raises instead of waiting forever or parsing half an event.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
from yarl import URL

from router.config import Timeouts

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Headers that describe one hop, not the answer; the router's own server sets them for its hop.
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"date",
        b"server",
        b"proxy-connection",
        b"upgrade",
        b"te",
        b"trailer",
    }
)
UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
# The most of one server-sent event held back while waiting for its end; a chat chunk is a few
# hundred bytes, one with logprobs a few KiB.
MAX_EVENT_BYTES = 1024 * 1024


class ConnectFailed(Exception):
    """Nothing came back from the replica: safe to try another one."""


class UpstreamTimeout(Exception):
    """The replica accepted the request but said nothing within the first-byte timeout."""


class StreamBroken(Exception):
    """The replica's answer stopped part way; carries what the client should be told."""


class EventTooLarge(Exception):
    """A server-sent event larger than the router holds whole."""


class Upstream:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None
        # For the one retry after a kept-alive connection turned out closed: a new connection,
        # since the pool may hold more that the engine closed at the same moment.
        self._fresh: aiohttp.ClientSession | None = None
        self._request_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None,
            sock_connect=timeouts.connect_s,
            # Governs every socket read: the response head, a whole non-streamed body, and a
            # stream's first event; `between_chunks_s` tightens it once a stream flows.
            sock_read=timeouts.first_byte_s,
        )

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=1024,
                limit_per_host=0,
                # Engines keep idle connections for a while too (uvicorn: 5 s); closing ours
                # first avoids writing a request into a socket the engine is closing.
                keepalive_timeout=4.0,
                ttl_dns_cache=300,
            ),
            timeout=self._request_timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=self._request_timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def open(self, url: URL, body: bytes) -> aiohttp.ClientResponse:
        assert self._session is not None, "upstream session not started"
        try:
            try:
                return await self._session.post(url, data=body, headers=UPSTREAM_HEADERS)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                # A kept-alive connection the engine closed while it sat in the pool (llama-server
                # drops idle ones after its 5 s keep-alive and when its HTTP threads are all
                # taken) disconnects, or refuses the body, before any answer: that says nothing
                # about the replica, so it is tried once more on a new connection before the
                # replica is counted as failed and ejected. A refused connect is the replica's
                # own answer and is not retried here.
                assert self._fresh is not None
                return await self._fresh.post(url, data=body, headers=UPSTREAM_HEADERS)
        except aiohttp.ConnectionTimeoutError as exc:
            raise ConnectFailed(f"connect timed out after {self.timeouts.connect_s:g}s") from exc
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamTimeout(f"no answer within {self.timeouts.first_byte_s:g}s") from exc
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A refused connection, or a kept-alive one the replica had already closed: the
            # replica has not started on this request.
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc


def response_headers(
    resp: aiohttp.ClientResponse, extra: tuple[tuple[bytes, bytes], ...]
) -> list[tuple[bytes, bytes]]:
    headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in HOP_HEADERS]
    headers.extend(extra)
    return headers


EVENT_SEPARATOR = re.compile(rb"\r?\n\r?\n")
# The last event of an OpenAI stream.
DONE_EVENT = b"data: [DONE]"


def event_end(data: bytes) -> int:
    """Where the last complete server-sent event in `data` ends (0: none yet). Events end with
    a blank line; sse-starlette, which llama-cpp-python uses, writes CRLF line ends."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def broken_stream(exc: BaseException, between_chunks_s: float) -> StreamBroken | None:
    """What a stream cut short by `exc` is reported as (None: not a broken stream)."""
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return StreamBroken("the replica sent nothing before the first-byte timeout")
    if isinstance(exc, TimeoutError):
        return StreamBroken(f"the replica sent nothing for {between_chunks_s:g}s mid-stream")
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
        return StreamBroken(f"the replica's connection broke mid-stream ({type(exc).__name__})")
    return None


async def read_events(
    resp: aiohttp.ClientResponse,
    on_event: Callable[[bytes], bool],
    *,
    between_chunks_s: float,
    max_event_bytes: int = MAX_EVENT_BYTES,
) -> bool:
    """Read a server-sent event stream, passing each whole event to `on_event` until it returns
    True (the stream's last event) or the body ends; returns whether `on_event` ended it.
    Raises StreamBroken as `relay_body` does, and EventTooLarge for an event that never ends."""
    content = resp.content
    pending = b""
    first = True
    try:
        while True:
            if first:
                chunk = await content.readany()
                first = False
            else:
                async with asyncio.timeout(between_chunks_s):
                    chunk = await content.readany()
            if not chunk:
                return False
            data = pending + chunk if pending else chunk
            cut = event_end(data)
            if cut == 0:
                if len(data) > max_event_bytes:
                    raise EventTooLarge(f"an event grew past {max_event_bytes} bytes without ending")
                pending = data
                continue
            pending = data[cut:]
            for event in EVENT_SEPARATOR.split(data[:cut]):
                if event and on_event(event):
                    return True
    except (TimeoutError, aiohttp.ClientError) as exc:
        broken = broken_stream(exc, between_chunks_s)
        if broken is None:
            raise
        raise broken from exc


async def relay_body(
    resp: aiohttp.ClientResponse,
    send: Send,
    *,
    between_chunks_s: float,
    on_first_byte: Callable[[], None],
    on_done: Callable[[], None] = lambda: None,
    max_event_bytes: int = MAX_EVENT_BYTES,
) -> None:
    """Pass a streamed body through chunk by chunk. Server-sent events are cut only at event
    boundaries, so that if the replica dies the client has whole events and then the error.

    A client that leaves meanwhile is noticed by the caller (see router/client.py), which
    cancels this and closes `resp`. `on_done` is called once the stream's `data: [DONE]` event
    has been passed on: the client has its whole answer."""
    sse = resp.content_type == "text/event-stream"
    content = resp.content
    pending = b""
    first = True
    done = False
    try:
        while True:
            if first:
                chunk = await content.readany()
            else:
                async with asyncio.timeout(between_chunks_s):
                    chunk = await content.readany()
            if not chunk:
                break
            if sse:
                data = pending + chunk if pending else chunk
                cut = event_end(data)
                if cut == 0:
                    if len(data) <= max_event_bytes:
                        pending = data
                        continue
                    # An event this large is not worth holding whole: pass it on as it comes,
                    # so a replica (or something pretending to be one) cannot grow the
                    # router's memory without bound.
                    cut = len(data)
                chunk, pending = data[:cut], data[cut:]
            if first:
                on_first_byte()
                first = False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if sse and chunk.rstrip().endswith(DONE_EVENT):
                done = True
                on_done()
    except (TimeoutError, aiohttp.ClientError) as exc:
        if not done:
            broken = broken_stream(exc, between_chunks_s)
            if broken is None:
                raise
            raise broken from exc
        # The answer is whole; a replica slow or rough in ending its body has failed no one.
        resp.close()
        pending = b""
    if pending:
        await send({"type": "http.response.body", "body": pending, "more_body": True})
    if first:
        on_first_byte()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
