"""A fixed-answer OpenAI-style engine for router tests that need control a real engine does not
give: a stream slow enough to kill in the middle, or an answer that names which replica served.

    python -m tests.router.stub_engine --port P --name NAME [--chunks N] [--chunk-delay S] [--status 500]

It prints a line for each proxied request it receives, so a test can count what reached it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class StubEngine:
    def __init__(
        self,
        name: str,
        chunks: int,
        chunk_delay: float,
        delay: float = 0.0,
        big_event: int = 0,
        done_linger: float = 0.0,
        status: int = 200,
    ) -> None:
        self.name = name
        self.status = status
        # Requests to the proxied paths, as the router's effect on the engine is counted.
        self.served = 0
        self.done_linger = done_linger
        self.big_event = big_event
        self.delay = delay
        self.chunks = chunks
        self.chunk_delay = chunk_delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/models":
            await self._json(send, {"object": "list", "data": [{"id": self.name, "object": "model"}]})
            return
        self.served += 1
        print(f"request {self.served} on {path}", flush=True)
        if self.status != 200:
            error = {"message": f"{self.name} always fails", "type": "server_error", "code": None}
            await self._json(send, {"error": error}, self.status)
            return
        request = json.loads(body or b"{}")
        if request.get("stream"):
            await self._stream(send, receive, request)
            return
        if path == "/v1/embeddings":
            await self._json(
                send,
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                    "model": self.name,
                    "usage": {"prompt_tokens": 1, "total_tokens": 1},
                },
            )
            return
        if self.delay:
            await asyncio.sleep(self.delay)
        await self._json(send, self._completion(request))

    def _completion(self, request: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.name}",
            "object": "chat.completion",
            "created": 0,
            "model": request.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"served by {self.name}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
        }

    async def _json(self, send: Send, payload: Any, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _stream(self, send: Send, receive: Receive, request: dict[str, Any]) -> None:
        gone = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        listener = asyncio.create_task(listen())
        try:
            sent = await self._events(send, request, gone)
        finally:
            listener.cancel()
        if gone.is_set():
            # What a test reads to know the engine stopped, and how much it had sent by then.
            print(f"stream ended: client gone after {sent} bytes", flush=True)

    async def _events(self, send: Send, request: dict[str, Any], gone: asyncio.Event) -> int:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        sent = 0
        if self.big_event:
            # One event of `big_event` bytes, its end held back for a while.
            await send(
                {"type": "http.response.body", "body": b"data: " + b"x" * self.big_event, "more_body": True}
            )
            await asyncio.sleep(3)
            await send({"type": "http.response.body", "body": b"\r\n\r\n", "more_body": True})
        for i in range(self.chunks):
            if gone.is_set():
                return sent
            chunk = {
                "id": f"chatcmpl-{self.name}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": request.get("model", ""),
                "choices": [{"index": 0, "delta": {"content": f"{self.name}-{i} "}, "finish_reason": None}],
            }
            event = b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
            sent += len(event)
            # Even without a delay, let other streams have their turn: a send that does not
            # block never yields, and one endless stream would starve the rest.
            await asyncio.sleep(self.chunk_delay)
        await send(
            {
                "type": "http.response.body",
                "body": b"data: [DONE]\r\n\r\n",
                "more_body": bool(self.done_linger),
            }
        )
        if self.done_linger:
            # The stream's end comes a while after its last event, as it may from a real server.
            await asyncio.sleep(self.done_linger)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return sent


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="stub")
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before a non-streamed answer")
    parser.add_argument("--big-event", type=int, default=0, help="bytes of one slow event first")
    parser.add_argument("--done-linger", type=float, default=0.0, help="seconds from [DONE] to the end")
    parser.add_argument("--status", type=int, default=200, help="answer every request with this status")
    args = parser.parse_args()
    app = StubEngine(
        args.name, args.chunks, args.chunk_delay, args.delay, args.big_event, args.done_linger, args.status
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
