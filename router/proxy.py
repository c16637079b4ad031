"""The relay that passes a replica's answer back to the client as it arrives (the connections
themselves are router/upstream.py's).

Once a stream is flowing and breaks, the client gets the events that arrived whole and then one
error event, so the SDK raises instead of waiting forever or parsing half an event.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

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
# The most of one server-sent event held back while waiting for its end; a chat chunk is a few
# hundred bytes, one with logprobs a few KiB.
MAX_EVENT_BYTES = 1024 * 1024
# The most of a stream read from its replica ahead of a slow client. The kernel holds about
# 4 MB more between the two (an engine's send buffer grows to tcp_wmem's 4 MiB); past both the
# engine's writes block and its slot waits for the client. 4 MiB is about 18,000 chat tokens of
# llama-cpp-python's events (235 bytes each); a client that reads nothing is dropped at the
# write deadline, so a stalled stream holds no more than its engine sends until then.
BACKLOG_BYTES = 4 * 1024 * 1024
# One write to the client takes at most this much of the backlog, so that the write deadline
# measures a stalled client, not the size of a write.
SEND_BYTES = 64 * 1024


class StreamBroken(Exception):
    """The replica's answer stopped part way; carries what the client should be told."""


class EventTooLarge(Exception):
    """A server-sent event larger than the router holds whole."""


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


async def next_chunk(content: aiohttp.StreamReader, within_s: float | None) -> bytes:
    """The body's next bytes (b"" at its end). The first chunk has no deadline here: the session's
    read timeout (`first_byte_s`) bounds it, since a long prefill takes minutes; every later one
    must come within `within_s` of the one before, or a hung engine holds the stream for ever."""
    if within_s is None:
        return await content.readany()
    async with asyncio.timeout(within_s):
        return await content.readany()


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
            chunk = await next_chunk(content, None if first else between_chunks_s)
            first = False
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


class Held:
    """Bytes read from replicas and not yet sent to their clients, all streams together: the
    memory slow clients cost the router (`llmgw_router_backlog_bytes`)."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class Backlog:
    """What a replica sent and its client has not yet taken, bounded in bytes.

    The replica's stream is read into it whatever the client does, so that a client that reads
    slowly, or not at all, does not hold the engine's slot: the engine finishes its answer at its
    own pace, and the client is fed from here (see `relay_body`). Past `limit` the reader waits,
    which holds the engine back only once the client is that far behind."""

    def __init__(self, limit: int, held: Held) -> None:
        self.limit = limit
        self.size = 0
        self._held = held
        self._chunks: deque[bytes] = deque()
        self._ended = False
        self._error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._data: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None

    async def put(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._grow(len(chunk))
        self._wake_taker()
        if self.size > self.limit:
            self._room = self._loop.create_future()
            await self._room

    def end(self, error: BaseException | None = None) -> None:
        self._ended = True
        self._error = error
        self._wake_taker()

    async def take(self, at_most: int) -> bytes:
        """The next chunks, joined up to `at_most` bytes (a larger chunk comes alone); b"" once the
        stream ended and everything before its end was taken; the reader's error after that."""
        while not self._chunks:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return b""
            self._data = self._loop.create_future()
            await self._data
        chunk = self._chunks.popleft()
        if self._chunks and len(chunk) < at_most:
            parts = [chunk]
            size = len(chunk)
            while self._chunks and size + len(self._chunks[0]) <= at_most:
                part = self._chunks.popleft()
                parts.append(part)
                size += len(part)
            chunk = b"".join(parts)
        self._grow(-len(chunk))
        if self._room is not None and self.size <= self.limit:
            if not self._room.done():
                self._room.set_result(None)
            self._room = None
        return chunk

    def discard(self) -> None:
        """The client will take nothing more (it left, or was dropped)."""
        self._chunks.clear()
        self._grow(-self.size)

    def _grow(self, delta: int) -> None:
        self.size += delta
        self._held.bytes += delta

    def _wake_taker(self) -> None:
        if self._data is not None:
            if not self._data.done():
                self._data.set_result(None)
            self._data = None


async def relay_body(
    resp: aiohttp.ClientResponse,
    send: Send,
    *,
    between_chunks_s: float,
    on_first_byte: Callable[[], None],
    on_done: Callable[[], None] = lambda: None,
    max_event_bytes: int = MAX_EVENT_BYTES,
    backlog_bytes: int = BACKLOG_BYTES,
    held: Held | None = None,
) -> None:
    """Pass a streamed body through chunk by chunk. Server-sent events are cut only at event
    boundaries, so that if the replica dies the client has whole events and then the error.

    The replica is read by a task of its own into a `Backlog`, and the client is written from
    it: a client that reads slowly or not at all costs the engine no more than one that reads
    (the write deadline still drops it; see router/client.py). A client that leaves meanwhile is
    noticed by the caller, which cancels this and closes `resp`. `on_done` is called once the
    stream's `data: [DONE]` event has been passed on: the client has its whole answer."""
    sse = resp.content_type == "text/event-stream"
    backlog = Backlog(backlog_bytes, held or Held())
    reader = asyncio.create_task(
        read_into(resp, backlog, sse=sse, between_chunks_s=between_chunks_s, max_event_bytes=max_event_bytes)
    )
    first = True
    try:
        while True:
            chunk = await backlog.take(SEND_BYTES)
            if not chunk:
                break
            if first:
                on_first_byte()
                first = False
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if sse and chunk.rstrip().endswith(DONE_EVENT):
                on_done()
    finally:
        backlog.discard()
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
    if first:
        on_first_byte()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_into(
    resp: aiohttp.ClientResponse,
    backlog: Backlog,
    *,
    sse: bool,
    between_chunks_s: float,
    max_event_bytes: int,
) -> None:
    """The replica's half of `relay_body`: its body into `backlog`, then the end, or the error
    the client should be told (StreamBroken) once it has what came before it."""
    content = resp.content
    pending = b""
    first = True
    done = False
    try:
        while True:
            chunk = await next_chunk(content, None if first else between_chunks_s)
            first = False
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
                done = done or chunk.rstrip().endswith(DONE_EVENT)
            await backlog.put(chunk)
    except (TimeoutError, aiohttp.ClientError) as exc:
        if not done:
            broken = broken_stream(exc, between_chunks_s)
            if broken is not None:
                broken.__cause__ = exc
            backlog.end(broken or exc)
            return
        # The answer is whole; a replica slow or rough in ending its body has failed no one.
        resp.close()
        pending = b""
    except Exception as exc:
        backlog.end(exc)
        return
    if pending:
        await backlog.put(pending)
    # The engine is done with this request: its connection goes back to the pool now, not once
    # a slow client has read the rest.
    resp.release()
    backlog.end()
