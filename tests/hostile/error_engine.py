"""An engine that answers every completion with an error quoting a credential, the way real
engines quote what they were given (a URL, a header) in their errors.

    python -m tests.hostile.error_engine --port P [--host H] [anything an engine is given]

The last user message picks the error: `json` (400, OpenAI's error object), `plain` (500, a
plain-text body), `in-stream` (200, the error object as the stream's one event). GET /v1/models
answers, so a readiness check passes. It takes the arguments a rendered job gives
llama_cpp.server and ignores all but --host and --port, so a node can run it as that engine.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

SECRET = "s3cr3tVALUE"
HF_TOKEN = "hf_" + "Q" * 30
# What the engine's errors quote: a source with a password, an HF token, a bearer header.
CREDENTIAL_TEXT = (
    f"GET https://user:{SECRET}@models.example/x.gguf failed (HF_TOKEN={HF_TOKEN}, "
    f"Authorization: Bearer {SECRET})"
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def last_prompt(request: dict[str, Any]) -> str:
    messages = request.get("messages") or [{"content": request.get("prompt", "")}]
    return str(messages[-1].get("content", ""))


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/models":
        await answer(send, 200, b"application/json", json.dumps({"object": "list", "data": []}).encode())
        return
    kind = last_prompt(json.loads(body or b"{}"))
    error = {"message": f"could not load the model: {CREDENTIAL_TEXT}", "type": "server_error", "code": 500}
    if kind == "plain":
        await answer(send, 500, b"text/plain", f"engine crashed: {CREDENTIAL_TEXT}".encode())
    elif kind == "in-stream":
        event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
        await answer(send, 200, b"text/event-stream", event)
    else:
        error.update(type="invalid_request_error", code=400)
        await answer(send, 400, b"application/json", json.dumps({"error": error}).encode())


async def answer(send: Send, status: int, content_type: bytes, payload: bytes) -> None:
    headers = [(b"content-type", content_type)]
    if content_type != b"text/event-stream":
        headers.append((b"content-length", str(len(payload)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args, _ = parser.parse_known_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()
