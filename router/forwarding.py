"""A request's trip to a replica and back: which replica (with room on it), the one send, and
the answer passed through, assembled, or turned into an error the client can act on.

The rules (docs/router.md, "Faults"): a replica takes at most `max_per_replica` requests at
once, and a request waits at most `pool_wait_s` for room before a 503; a request goes to
another replica only while none has seen it (the connection could not be opened); every answer
is counted for the replica's outlier standing (router/outliers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable
from typing import Any

import aiohttp
from yarl import URL

from nomad_driver.safeload import LoadError, json_loads
from router import errors
from router.activity import ActivityRecorder
from router.assemble import USAGE_COUNTED, AssemblyFailed, assemble, needs_stream, streamed_body
from router.client import BODY, FIRST_BYTE, STREAM, UPSTREAM, ClientConnection
from router.config import RouterConfig
from router.discovery import Discovery, Replica
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.proxy import StreamBroken, relay_body, response_headers
from router.routing import Balancer, prefix_hashes, prompt_text, session_hash
from router.upstream import ConnectFailed, RequestLost, Upstream, UpstreamTimeout, keeps_connections

log = logging.getLogger("llmgw.router")

# Paths proxied to a replica, and whether their prompt is worth routing on.
PROXY_PATHS = {"/v1/chat/completions": True, "/v1/completions": True, "/v1/embeddings": False}
# A replica refusing connections is tried at most this many times per request, each a different
# replica; past that the fleet has a wider problem than one dead replica.
MAX_CONNECT_ATTEMPTS = 3
# The most of an engine's chunked error answer read to redact it; an error is a few hundred bytes.
MAX_ERROR_BYTES = 1024 * 1024


async def send_error(client: ClientConnection, err: RouterError) -> None:
    """`err` as an answer, or as the last event of a stream whose head already went out."""
    if not client.started:
        headers = [(b"content-type", b"application/json"), *err.headers]
        body = err.body()
        headers.append((b"content-length", str(len(body)).encode()))
        await client.send({"type": "http.response.start", "status": err.status, "headers": headers})
        await client.send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await client.send({"type": "http.response.body", "body": err.sse_frame(), "more_body": True})
    await client.send({"type": "http.response.body", "body": b"", "more_body": False})


class Forwarder:
    def __init__(
        self,
        config: RouterConfig,
        balancer: Balancer,
        discovery: Discovery,
        upstream: Upstream,
        activity: ActivityRecorder,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.balancer = balancer
        self.discovery = discovery
        self.upstream = upstream
        self.activity = activity
        self.metrics = metrics
        self.max_per_replica = config.limits.max_per_replica
        self._urls: dict[tuple[str, int, str], URL] = {}
        # Requests waiting for room on a model's replicas, woken when one of its requests ends.
        self._room: dict[str, asyncio.Event] = {}

    async def forward(
        self,
        client: ClientConnection,
        path: str,
        model: str,
        body: bytes,
        request: dict[str, Any],
        session_header: bytes | None,
        arrived: float,
    ) -> int:
        balancer = self.balancer
        definition = self.discovery.snapshot.models.get(model)
        engine = definition.profile.engine if definition else None
        assembled = needs_stream(engine, path, request)
        reuse = keeps_connections(engine)
        if assembled:
            body = streamed_body(request)
        tried: list[Hashable] = []
        prefix: list[int] | None = None
        session: int | None = None
        failure = ""
        deadline: float | None = None
        while len(tried) < MAX_CONNECT_ATTEMPTS:
            snapshot = self.discovery.snapshot
            now = time.monotonic()
            candidates = [r.key for r in snapshot.serving(model) if r.key not in tried]
            if not candidates:
                # The current definition's replicas were all tried: a previous definition's
                # that still serve (a rollout) are better than an error.
                candidates = [r.key for r in snapshot.ready.get(model, ()) if r.key not in tried]
            if not candidates:
                break
            outstanding = balancer.outstanding
            with_room = [k for k in candidates if outstanding.get(k, 0) < self.max_per_replica]
            if not with_room:
                deadline = deadline or now + self.config.timeouts.pool_wait_s
                if now >= deadline:
                    raise self._busy(model)
                await self._wait_for_room(model, deadline - now)
                continue
            if len(with_room) == 1 and not balancer.outliers.any_ejected():
                # One replica, no choice to make: skip hashing the prompt.
                key: Hashable | None = with_room[0]
            else:
                if prefix is None:
                    prefix, session = self._routing_keys(path, request, session_header)
                key = balancer.choose(model, with_room, prefix=prefix, session=session, now=now)
            assert key is not None
            replica = snapshot.by_key[key]  # type: ignore[index]
            balancer.acquire(key)
            self.activity.begin(model, replica.id)
            try:
                client.phase = UPSTREAM
                try:
                    resp = await self.upstream.open(self._url(replica, path), body, reuse=reuse)
                except ConnectFailed as exc:
                    # Never sent: another replica may take it.
                    tried.append(key)
                    failure = f"{replica.name} at {replica.host}:{replica.port}: {exc}"
                    self._connection_failed(replica, "connect", failure)
                    continue
                except UpstreamTimeout as exc:
                    self._failed(replica, "timeout", str(exc))
                    raise RouterError(
                        504,
                        "upstream_timeout",
                        f"replica {replica.name} of model '{model}' accepted the request but {exc}",
                        type_="server_error",
                    ) from exc
                except RequestLost as exc:
                    self._connection_failed(replica, "closed", str(exc))
                    detail = (
                        f"replica {replica.name} of model '{model}' {exc}; it was not sent again, "
                        "since the engine may have acted on it (a request that crashes its engine "
                        "would crash every replica); retry only if that is safe"
                    )
                    if exc.code == "upstream_invalid":
                        raise RouterError(
                            502, "upstream_invalid", detail, type_="server_error", headers=errors.NO_RETRY
                        ) from exc
                    raise RouterError(
                        502, "upstream_closed", detail, type_="server_error", headers=errors.NO_RETRY
                    ) from exc
                try:
                    if assembled and resp.status == 200 and resp.content_type == "text/event-stream":
                        status = await self._assemble(resp, client, replica, arrived, path)
                    else:
                        status = await self._respond(resp, client, replica, arrived)
                except BaseException:
                    # Closing, not releasing: the engine sees its connection go and stops
                    # generating (a client that left, a stream that broke).
                    resp.close()
                    raise
                finally:
                    resp.release()
                if resp.status >= 500:
                    self._failed(replica, "5xx", f"answered {resp.status}")
                elif status < 500:
                    balancer.outliers.succeeded(key)
                return status
            finally:
                balancer.release(key)
                self.activity.end(model, replica.id)
                room = self._room.pop(model, None)
                if room is not None:
                    room.set()
        raise RouterError(
            502,
            "upstream_unavailable",
            f"no replica of model '{model}' accepted a connection"
            + (f" ({len(tried)} tried; last: {failure})" if tried else " (none is ready)")
            + "; the request was sent to none of them; retry shortly",
            type_="server_error",
            headers=((b"retry-after", b"1"),),
        )

    async def _wait_for_room(self, model: str, timeout: float) -> None:
        room = self._room.get(model)
        if room is None:
            room = self._room[model] = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await room.wait()

    def _busy(self, model: str) -> RouterError:
        self.metrics.refusals.labels(model, "busy").inc()
        ready = len(self.discovery.snapshot.ready.get(model, ()))
        return RouterError(
            503,
            "replicas_busy",
            f"every ready replica of model '{model}' ({ready}) already has {self.max_per_replica} "
            f"requests in flight from this router, and none made room within "
            f"{self.config.timeouts.pool_wait_s:g}s; retry in a second",
            type_="server_error",
            # Honest: room frees as answers end, so a retry after a pause is likely to be served.
            headers=((b"retry-after", b"1"), (b"x-should-retry", b"true")),
        )

    async def _respond(self, resp: Any, client: ClientConnection, replica: Replica, arrived: float) -> int:
        model = replica.model
        if client.started:
            return await self._respond_in_stream(resp, client, replica, arrived)
        headers = response_headers(resp, ((b"x-llmgw-replica", replica.id.encode()),))
        if resp.content_length is not None or resp.status >= 400:
            client.phase = BODY
            try:
                # A chunked error answer is read whole too, bounded, so it can be redacted.
                payload = await (
                    resp.read() if resp.content_length is not None else resp.content.read(MAX_ERROR_BYTES)
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Nothing has gone to the client yet, so it gets a proper error answer.
                self._connection_failed(replica, "stream", f"{exc!r}")
                raise RouterError(
                    502,
                    "upstream_failed",
                    f"replica {replica.name} of model '{model}' failed while answering "
                    f"({type(exc).__name__}); retry",
                    type_="server_error",
                ) from exc
            if resp.status >= 400:
                # An engine's error quotes what it was given: a source, a token, a header.
                payload = errors.redacted(payload)
            headers.append((b"content-length", str(len(payload)).encode()))
            await client.send({"type": "http.response.start", "status": resp.status, "headers": headers})
            self.metrics.observe_ttfb(model, time.monotonic() - arrived)
            await client.send({"type": "http.response.body", "body": payload, "more_body": False})
            return int(resp.status)

        await client.send({"type": "http.response.start", "status": resp.status, "headers": headers})
        return await self._relay(resp, client, replica, arrived)

    async def _assemble(
        self, resp: Any, client: ClientConnection, replica: Replica, arrived: float, path: str
    ) -> int:
        """A non-streamed answer read from the stream the router asked for (router/assemble.py):
        a client that leaves meanwhile closes the stream, and the engine stops."""
        client.phase = BODY
        try:
            status, payload, counted = await assemble(
                resp,
                chat=path == "/v1/chat/completions",
                between_chunks_s=self.config.timeouts.between_chunks_s,
            )
        except (StreamBroken, AssemblyFailed) as exc:
            self._connection_failed(replica, "stream", str(exc))
            if isinstance(exc, AssemblyFailed):
                raise exc.error(replica.name, replica.model) from exc
            raise RouterError(
                502,
                "upstream_failed",
                f"replica {replica.name} of model '{replica.model}' failed while answering: {exc}; retry",
                type_="server_error",
            ) from exc
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"x-llmgw-replica", replica.id.encode()),
        ]
        if counted:
            headers.append(USAGE_COUNTED)
        await client.send({"type": "http.response.start", "status": status, "headers": headers})
        self.metrics.observe_ttfb(replica.model, time.monotonic() - arrived)
        await client.send({"type": "http.response.body", "body": payload, "more_body": False})
        return status

    async def _relay(self, resp: Any, client: ClientConnection, replica: Replica, arrived: float) -> int:
        model = replica.model
        client.phase = FIRST_BYTE

        def first_byte() -> None:
            client.phase = STREAM
            self.metrics.observe_ttfb(model, time.monotonic() - arrived)

        try:
            await relay_body(
                resp,
                client.send,
                between_chunks_s=self.config.timeouts.between_chunks_s,
                on_first_byte=first_byte,
                on_done=client.mark_answered,
                held=self.upstream.held,
            )
        except StreamBroken as exc:
            resp.close()
            self._connection_failed(replica, "stream", str(exc))
            if resp.content_type != "text/event-stream":
                # No way to say "error" inside a plain body: drop the connection, so the
                # client sees a truncated answer rather than a complete-looking wrong one.
                raise
            err = RouterError(
                502,
                "upstream_failed",
                f"replica {replica.name} of model '{model}' failed mid-stream: {exc}; retry the request",
                type_="server_error",
            )
            await send_error(client, err)
            return 502
        return int(resp.status)

    async def _respond_in_stream(
        self, resp: Any, client: ClientConnection, replica: Replica, arrived: float
    ) -> int:
        """The replica's answer for a stream that already started with keepalives: its events
        as they come, or its refusal (a 400 for a bad request, say) as one error event."""
        if resp.status == 200 and resp.content_type == "text/event-stream":
            return await self._relay(resp, client, replica, arrived)
        client.phase = BODY
        try:
            payload = await resp.content.read(64 * 1024)
        except aiohttp.ClientError:
            payload = b""
        message = payload.decode("utf-8", "replace").strip() or f"HTTP {resp.status}"
        err = RouterError(
            resp.status if resp.status >= 400 else 502,
            "upstream_error",
            f"replica {replica.name} of model '{replica.model}' answered {resp.status}: {message[:2000]}",
            type_="server_error" if resp.status >= 500 else "invalid_request_error",
        )
        try:
            upstream = json_loads(payload, f"the answer of replica {replica.name}")
        except LoadError:
            upstream = None
        if isinstance(upstream, dict) and isinstance(upstream.get("error"), dict):
            # The engine's own error object, passed on as the SDK would have seen it.
            frame = errors.engine_error_frame(upstream["error"])
            await client.send({"type": "http.response.body", "body": frame, "more_body": True})
            await client.send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send_error(client, err)
        return int(resp.status)

    def _routing_keys(
        self, path: str, request: dict[str, Any], session_header: bytes | None
    ) -> tuple[list[int], int | None]:
        session: int | None = None
        if session_header:
            session = session_hash(session_header.decode("latin-1"))
        else:
            user = request.get("user")
            if isinstance(user, str) and user:
                session = session_hash(user)
        prefix = prefix_hashes(prompt_text(request)) if PROXY_PATHS[path] else []
        return prefix, session

    def _url(self, replica: Replica, path: str) -> URL:
        key = (replica.host, replica.port, path)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = URL(replica.base_url + path)
        return url

    def forget(self, replica: Replica) -> None:
        self.balancer.forget(replica.key)
        for path in PROXY_PATHS:
            self._urls.pop((replica.host, replica.port, path), None)

    def _connection_failed(self, replica: Replica, phase: str, detail: str) -> None:
        self.metrics.upstream_failures.labels(replica.model, phase).inc()
        self.balancer.outliers.connection_failed(replica.key, time.monotonic())
        log.warning(
            "event=replica_failed model=%s replica=%s phase=%s detail=%r",
            replica.model,
            replica.name,
            phase,
            detail,
        )

    def _failed(self, replica: Replica, phase: str, detail: str) -> None:
        """A 5xx or a timeout: counted toward the replica's ejection, not ejecting at once."""
        if phase != "5xx":
            self.metrics.upstream_failures.labels(replica.model, phase).inc()
        self.balancer.outliers.failed(replica.key, time.monotonic())
