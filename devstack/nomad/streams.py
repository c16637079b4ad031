"""The two streaming endpoints: the event stream (`command/agent/event_endpoint.go`) and task
logs (`command/agent/fs_endpoint.go`), raw with `plain=true` or framed as Nomad frames them.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from aiohttp import web

from devstack.nomad.answers import NAMESPACE, ApiError
from devstack.nomad.encode import dumps
from devstack.nomad.events import TopicFilter
from devstack.nomad.httpbase import HEARTBEAT_KEY, SERVER_KEY, bool_param, only

EVENT_HEARTBEAT_S = 10.0
LOG_FOLLOW_POLL_S = 0.2
LOG_FRAME_BYTES = 64 * 1024


async def event_stream(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    try:
        index = int(request.query.get("index", "0") or 0)
    except ValueError as exc:
        raise ApiError(400, f"Unable to parse index: {exc}") from None
    try:
        topics = TopicFilter.parse(request.query.getall("topic", []))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    namespace = request.query.get("namespace") or NAMESPACE
    response = web.StreamResponse(headers={"Content-Type": "application/json", "Cache-Control": "no-cache"})
    await response.prepare(request)
    heartbeat = request.app[HEARTBEAT_KEY]
    frames = server.events.subscribe(index, topics, namespace, heartbeat)
    try:
        async for frame in frames:
            await response.write(dumps(frame) + b"\n")
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        await frames.aclose()
    return response


async def fs_logs(request: web.Request) -> web.StreamResponse:
    """`/v1/client/fs/logs/<alloc>`: a task's stdout or stderr, as raw text with plain=true or as
    Nomad's JSON stream frames `{"Offset", "Data" (base64), "File"}` without."""
    only(request, "GET")
    server = request.app[SERVER_KEY]
    alloc_id = request.match_info["alloc"]
    if alloc_id not in server.store.allocs:
        raise ApiError(404, "alloc not found")
    task = request.query.get("task")
    if not task:
        raise ApiError(400, "must include task name")
    kind = request.query.get("type", "")
    if kind not in ("stdout", "stderr"):
        raise ApiError(400, f'illegal log type: "{kind}"')
    origin = request.query.get("origin", "start")
    if origin not in ("start", "end"):
        raise ApiError(400, 'Origin must be "start" or "end"')
    try:
        offset = int(request.query.get("offset", "0") or 0)
    except ValueError as exc:
        raise ApiError(400, f"Failed to parse offset: {exc}") from None
    plain = bool_param(request, "plain")
    follow = bool_param(request, "follow")
    path = server.log_path(alloc_id, task, kind)
    data = path.read_bytes() if path.exists() else b""
    start = max(0, len(data) - offset) if origin == "end" else min(offset, len(data))
    if not follow:
        chunk = data[start:]
        if plain:
            return web.Response(body=chunk, content_type="text/plain")
        return web.Response(body=_frames(chunk, start, path), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/plain" if plain else "application/json"})
    await response.prepare(request)
    position = start
    try:
        while True:
            size = path.stat().st_size if path.exists() else 0
            if size < position:  # truncated or rotated: start over, as tail -F does
                position = 0
            if size > position:
                with path.open("rb") as f:
                    f.seek(position)
                    chunk = f.read(size - position)
                await response.write(chunk if plain else _frames(chunk, position, path))
                position += len(chunk)
            await asyncio.sleep(LOG_FOLLOW_POLL_S)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return response


def _frames(chunk: bytes, offset: int, path: Path) -> bytes:
    out = []
    for i in range(0, len(chunk), LOG_FRAME_BYTES):
        part = chunk[i : i + LOG_FRAME_BYTES]
        out.append(
            dumps(
                {"Data": base64.b64encode(part).decode(), "Offset": offset + i + len(part), "File": path.name}
            )
        )
    return b"".join(out)
