"""The client's side of a proxied request: noticing that the client left, and not waiting on
one that stopped reading.

A client that hangs up must cost nothing: whatever its request is doing at that moment
(waiting for a replica, connecting, waiting for the first token, reading a whole answer,
streaming), it is stopped at once, and closing the replica's connection is what makes the
engine stop generating. So once the request is read, one small task listens for the server's
`http.disconnect` and cancels the request's task; every phase's `finally` closes what it holds.
A client that stays connected but stops reading is caught by a deadline on each write: the
server's flow control blocks the write once the socket's buffers are full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# How far a request had come when its client left, as counted in
# `llmgw_router_early_ends_total{kind}`; `stopped_reading` is a client dropped at the write
# deadline.
WAITING = "waiting"
UPSTREAM = "upstream"
FIRST_BYTE = "first_byte"
BODY = "body"
STREAM = "stream"
STOPPED_READING = "stopped_reading"
EARLY_ENDS = (WAITING, UPSTREAM, FIRST_BYTE, BODY, STREAM, STOPPED_READING)


class ClientLeft(Exception):
    """The client is gone (hung up, or stopped reading); nothing more can be sent to it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class ClientConnection:
    def __init__(self, receive: Receive, send: Send, send_timeout_s: float) -> None:
        self._receive = receive
        self._send = send
        self.send_timeout_s = send_timeout_s
        self.phase = WAITING
        self.started = False
        self.finished = False
        # The client has every byte of its answer it will read (a stream's `data: [DONE]`):
        # a hang-up from here on is a client that is done, not one that left early.
        self.answered = False
        # Set by the listener when the client hung up, before it cancels the request's task.
        self.gone = False
        self._task: asyncio.Task[Any] | None = None
        self._listener: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """From now on, a hang-up cancels the calling task. Call only once the request body has
        been read: the server's next message is then the disconnect and nothing else."""
        self._task = asyncio.current_task()
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        # The server also reports a disconnect once the answer is complete; that one is no
        # early end, and neither is the SDK closing at `data: [DONE]` before the replica ends
        # its body (the relay then ends by itself).
        if not self.finished and not self.answered and self._task is not None:
            self.gone = True
            self._task.cancel()

    def mark_answered(self) -> None:
        self.answered = True

    def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.finished = True
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await self._send(message)
        except TimeoutError:
            raise ClientLeft(STOPPED_READING) from None
        except OSError:
            if self.answered:
                return
            # The server refuses writes to a connection it knows is closed.
            raise ClientLeft(self.phase) from None

    def early_end(self) -> str:
        """The kind of early end, for a request cancelled because its client hung up."""
        task = asyncio.current_task()
        if task is not None:
            # The cancel was ours and is handled: later waits in this task must not see it.
            with contextlib.suppress(AttributeError):
                task.uncancel()
        return self.phase
