"""The router's HTTP face: one OpenAI-compatible address for every model.

A bare ASGI application rather than a framework: the hot path reads the body, parses it once,
picks a replica and hands bytes through, and every layer a framework adds in between (request
objects, dependency injection, response classes) was measurable against a plain aiohttp proxy.
The four small GET endpoints do not need a framework either.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from yarl import URL

from nomad_driver.certs import register_cert_collector
from nomad_driver.safeload import LoadError, json_loads
from router import errors
from router import status as views
from router.activation import Activator
from router.activity import WAITING, ActivityRecorder
from router.assemble import USAGE_COUNTED, AssemblyFailed, assemble, needs_stream, streamed_body
from router.client import BODY, FIRST_BYTE, STOPPED_READING, STREAM, UPSTREAM, ClientConnection, ClientLeft
from router.config import RouterConfig
from router.discovery import Discovery, Replica, Snapshot
from router.errors import RouterError
from router.http import ClientGone, parse_request, read_body, read_headers, send_bytes, send_error, send_json
from router.metrics import UNKNOWN_MODEL, DiscoveryCollector, RouterMetrics
from router.proxy import ConnectFailed, StreamBroken, Upstream, UpstreamTimeout, relay_body, response_headers
from router.routing import Balancer, prefix_hashes, prompt_text, session_hash

log = logging.getLogger("llmgw.router")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Paths proxied to a replica, and whether their prompt is worth routing on.
PROXY_PATHS = {"/v1/chat/completions": True, "/v1/completions": True, "/v1/embeddings": False}
# A replica refusing connections is tried at most this many times per request, each a different
# replica; past that the fleet has a wider problem than one dead replica.
MAX_CONNECT_ATTEMPTS = 3
CLIENT_CLOSED = 499
# The head of a stream that starts before its replica is ready (keepalive comments first).
SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # nginx buffers a proxied answer unless told not to, which would hold back the keepalives.
    (b"x-accel-buffering", b"no"),
)


@dataclass
class Outcome:
    """What one proxied request is counted as: its model (once known) and its status."""

    label: str = UNKNOWN_MODEL
    status: int = 500


class RouterApp:
    def __init__(self, config: RouterConfig, *, activation: bool = True) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        # The serving certificate beside the Nomad and Consul ones: an expired one fails every
        # client's handshake, so it is watched like the others (read from disk at each scrape).
        register_cert_collector(self.metrics.registry, extra=[config.tls_cert] if config.tls_cert else [])
        self.balancer = Balancer(
            slack=config.affinity_slack, balance_factor=config.balance_factor, policy=config.policy
        )
        self.discovery = Discovery(
            config.consul, models_file=config.models_file, on_change=self._snapshot_changed
        )
        self.upstream = Upstream(config.timeouts)
        self.activation = activation
        self.activity = ActivityRecorder(self.discovery.put_kv, config.activity_interval_s)
        # The router asks; the leading watcher scales (the one writer of every job's count).
        self.activator = Activator(
            self.activity.ask,
            self.activity.served,
            self.discovery,
            self.metrics,
            config.timeouts,
            config.retry_after_s,
            max_waiting=config.max_waiting,
        )
        self._keys = tuple(k.encode() for k in config.api_keys)
        self._urls: dict[tuple[str, int, str], URL] = {}
        self._seen_models: set[str] = set()
        self.metrics.add_collector(
            DiscoveryCollector(
                self._replica_counts, self.discovery.watch_ages, lambda: self.discovery.consul_up
            )
        )
        held = self.upstream.held
        Gauge(
            "llmgw_router_backlog_bytes",
            "Bytes of streams read from replicas ahead of their clients, not yet sent to them.",
            registry=self.metrics.registry,
        ).set_function(lambda: held.bytes)
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.upstream.start()
        await self.discovery.start()
        self.activity.start()
        # Everything allocated so far lives as long as the process; taking it out of the
        # collector's view keeps full collections, and the tail latency they cause, short.
        gc.freeze()

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        await self.activator.close()
        await self.activity.stop()
        await self.discovery.stop()
        await self.upstream.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- dispatch -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path in PROXY_PATHS:
                await self._proxy(scope, receive, send, path)
                return
            try:
                if path == "/v1/models":
                    self._check_method(scope, "GET")
                    self._authenticate(scope)
                    await send_json(send, 200, self.models_listing())
                elif path == "/healthz":
                    self._check_method(scope, "GET")
                    status, body = self.health()
                    await send_json(send, status, body)
                elif path == "/metrics":
                    self._check_method(scope, "GET")
                    payload = generate_latest(self.metrics.registry)
                    headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
                    await send_bytes(send, 200, payload, headers)
                else:
                    raise RouterError(404, "not_found", f"no route for {scope['method']} {path}")
            except RouterError as err:
                await send_error(send, err)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    def _check_method(self, scope: Scope, method: str) -> None:
        if scope["method"] != method:
            raise RouterError(
                405, "method_not_allowed", f"{scope['path']} takes {method}, not {scope['method']}"
            )

    def _authenticate(self, scope: Scope) -> None:
        if not self._keys:
            return
        for name, value in scope["headers"]:
            if name == b"authorization":
                self._check_key(value)
                return
        raise errors.unauthorized("missing API key: send it as 'Authorization: Bearer <key>'")

    def _check_key(self, header: bytes) -> None:
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        matched = False
        # Every key is compared, match or not, so the time taken says nothing about which
        # key, or how much of one, a guess got right.
        for key in self._keys:
            matched |= hmac.compare_digest(key, token)
        if scheme.lower() != b"bearer" or not matched:
            raise errors.unauthorized("invalid API key")

    # -- the proxied endpoints ----------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        arrived = time.monotonic()
        client = ClientConnection(receive, send, self.config.timeouts.client_send_s)
        outcome = Outcome()
        try:
            await self._handle(scope, receive, client, path, arrived, outcome)
        except asyncio.CancelledError:
            if not client.gone:
                raise
            # The client hung up: everything its request held is closed by now, the
            # replica's connection included, so the engine stops working for nobody.
            outcome.status = CLIENT_CLOSED
            self.metrics.early_end(outcome.label, client.early_end())
        except ClientLeft as left:
            outcome.status = CLIENT_CLOSED
            self.metrics.early_end(outcome.label, left.kind)
            if left.kind == STOPPED_READING:
                log.warning(
                    "dropped a client of %s that read nothing for %gs; its replica's request is cancelled",
                    outcome.label,
                    self.config.timeouts.client_send_s,
                )
        finally:
            client.close()
            self.metrics.count_request(outcome.label, outcome.status, time.monotonic() - arrived)

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        client: ClientConnection,
        path: str,
        arrived: float,
        outcome: Outcome,
    ) -> None:
        try:
            if scope["method"] != "POST":
                raise RouterError(405, "method_not_allowed", f"{path} takes POST, not {scope['method']}")
            auth, session_header = read_headers(scope, self.config.limits)
            if self._keys:
                if auth is None:
                    raise errors.unauthorized("missing API key: send it as 'Authorization: Bearer <key>'")
                self._check_key(auth)
            timeouts = self.config.timeouts
            body = await read_body(
                receive, self.config.limits.max_body_bytes, timeouts.body_read_s, timeouts.request_body_s
            )
            request = parse_request(body)
            model = request["model"]
            client.watch()
            snapshot = self.discovery.snapshot
            ready = snapshot.ready.get(model)
            if not ready:
                if not self.discovery.has_snapshot:
                    raise RouterError(
                        503,
                        "router_starting",
                        "the router has not read the fleet from Consul yet; retry in a second",
                        type_="server_error",
                        headers=((b"retry-after", b"1"),),
                    )
                if model not in snapshot.known_models():
                    raise errors.model_not_found(model, snapshot.known_models())
                outcome.label = model
                # Waiting for a replica is in flight too: the watcher must not stop the one
                # being started for it.
                self.activity.begin(model, WAITING)
                served = False
                try:
                    if request.get("stream") is True:
                        await self._wait_streaming(client, model, snapshot, arrived)
                    else:
                        await self._without_replica(model, snapshot, arrived)
                    served = True
                finally:
                    self.activity.end(model, WAITING, demand=served)
            outcome.label = model
            self.activity.touch(model)
            outcome.status = await self._forward(client, path, model, body, request, session_header, arrived)
        except RouterError as err:
            outcome.status = err.status
            await self._send_error(client, err)
        except ClientGone:
            outcome.status = CLIENT_CLOSED
        except StreamBroken:
            # Re-raised so that the server drops the connection mid-body (see _respond).
            outcome.status = 502
            raise

    async def _send_error(self, client: ClientConnection, err: RouterError) -> None:
        if not client.started:
            await send_error(client.send, err)
            return
        # The stream's head went out while the request waited: the same answer as an event.
        await client.send({"type": "http.response.body", "body": err.sse_frame(), "more_body": True})
        await client.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _wait_streaming(
        self, client: ClientConnection, model: str, snapshot: Snapshot, arrived: float
    ) -> None:
        """`_without_replica` for a streamed request: answered as plainly as any other if the
        answer comes within one keepalive interval; past that the stream starts with comment
        lines every interval, so that no proxy or client read timeout ends a cold start."""
        waiting = asyncio.ensure_future(self._without_replica(model, snapshot, arrived))
        try:
            while True:
                done, _ = await asyncio.wait((waiting,), timeout=self.config.keepalive_s)
                if done:
                    waiting.result()
                    return
                if not client.started:
                    await client.send(
                        {"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)}
                    )
                await client.send(
                    {"type": "http.response.body", "body": errors.keepalive(model), "more_body": True}
                )
        finally:
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

    async def _without_replica(self, model: str, snapshot: Snapshot, arrived: float) -> None:
        """Refuse, or activate and wait; returns only when `model` has a ready replica."""
        state = snapshot.states.get(model)
        if state is not None and state.parked:
            self.metrics.refusals.labels(model, "parked").inc()
            raise errors.parked(model, state.consecutive_failures, state.last_error)
        definition = snapshot.models.get(model)
        if definition is None or not self.activation:
            if state is not None and state.unplaceable:
                # Nothing here can ask Nomad again, so the watcher's last answer is the best one.
                self.metrics.refusals.labels(model, "unplaceable").inc()
                raise errors.unplaceable(model, state.placement_reason)
            raise RouterError(
                503,
                "no_ready_replica",
                f"model '{model}' has no ready replica"
                + ("" if definition else " and no definition to start one from")
                + f"; retry in {self.config.retry_after_s}s",
                type_="model_unavailable",
                headers=((b"retry-after", str(self.config.retry_after_s).encode()),),
            )
        await self.activator.activate(definition, arrived)

    async def _forward(
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
        assembled = needs_stream(definition.profile.engine if definition else None, path, request)
        if assembled:
            body = streamed_body(request)
        tried: list[str] = []
        prefix: list[int] | None = None
        session: int | None = None
        failure = ""
        for _ in range(MAX_CONNECT_ATTEMPTS):
            snapshot = self.discovery.snapshot
            ready = snapshot.ready.get(model, ())
            now = time.monotonic()
            if len(ready) == 1 and not tried and not balancer.ejected(now):
                # One replica, no choice to make: skip hashing the prompt.
                replica_id: str | None = ready[0].id
            else:
                if prefix is None:
                    prefix, session = self._routing_keys(path, request, session_header)
                replica_id = balancer.choose(
                    model, [r.id for r in ready], prefix=prefix, session=session, exclude=tried, now=now
                )
            if replica_id is None:
                break
            replica = snapshot.by_id[replica_id]
            balancer.acquire(replica_id)
            self.activity.begin(model, replica_id)
            try:
                client.phase = UPSTREAM
                try:
                    resp = await self.upstream.open(self._url(replica, path), body)
                except ConnectFailed as exc:
                    tried.append(replica_id)
                    failure = f"{replica_id} at {replica.host}:{replica.port}: {exc}"
                    self._replica_failed(replica, "connect", failure)
                    continue
                except UpstreamTimeout as exc:
                    raise RouterError(
                        504,
                        "upstream_timeout",
                        f"replica {replica_id} of model '{model}' accepted the request but {exc}",
                        type_="server_error",
                    ) from exc
                try:
                    if assembled and resp.status == 200 and resp.content_type == "text/event-stream":
                        return await self._assemble(resp, client, replica, arrived, path)
                    return await self._respond(resp, client, replica, arrived)
                except BaseException:
                    # Closing, not releasing: the engine sees its connection go and stops
                    # generating (a client that left, a stream that broke).
                    resp.close()
                    raise
                finally:
                    resp.release()
            finally:
                balancer.release(replica_id)
                self.activity.end(model, replica_id)
        raise RouterError(
            502,
            "upstream_unavailable",
            f"no replica of model '{model}' accepted the request"
            + (f" ({len(tried)} tried; last: {failure})" if tried else " (none is ready)")
            + "; retry shortly",
            type_="server_error",
            headers=((b"retry-after", b"1"),),
        )

    async def _respond(self, resp: Any, client: ClientConnection, replica: Replica, arrived: float) -> int:
        model = replica.model
        if client.started:
            return await self._respond_in_stream(resp, client, replica, arrived)
        headers = response_headers(resp, ((b"x-llmgw-replica", replica.id.encode()),))
        if resp.content_length is not None:
            client.phase = BODY
            try:
                payload = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Nothing has gone to the client yet, so it gets a proper error answer.
                self._replica_failed(replica, "stream", f"{replica.id}: {exc!r}")
                raise RouterError(
                    502,
                    "upstream_failed",
                    f"replica {replica.id} of model '{model}' failed while answering "
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
            self._replica_failed(replica, "stream", f"{replica.id}: {exc}")
            if isinstance(exc, AssemblyFailed):
                raise exc.error(replica.id, replica.model) from exc
            raise RouterError(
                502,
                "upstream_failed",
                f"replica {replica.id} of model '{replica.model}' failed while answering: {exc}; retry",
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
            self._replica_failed(replica, "stream", f"{replica.id}: {exc}")
            if resp.content_type != "text/event-stream":
                # No way to say "error" inside a plain body: drop the connection, so the
                # client sees a truncated answer rather than a complete-looking wrong one.
                raise
            err = RouterError(
                502,
                "upstream_failed",
                f"replica {replica.id} of model '{model}' failed mid-stream: {exc}; retry the request",
                type_="server_error",
            )
            await self._send_error(client, err)
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
            f"replica {replica.id} of model '{replica.model}' answered {resp.status}: {message[:2000]}",
            type_="server_error" if resp.status >= 500 else "invalid_request_error",
        )
        try:
            upstream = json_loads(payload, f"the answer of replica {replica.id}")
        except LoadError:
            upstream = None
        if isinstance(upstream, dict) and isinstance(upstream.get("error"), dict):
            # The engine's own error object, passed on as the SDK would have seen it.
            frame = errors.engine_error_frame(upstream["error"])
            await client.send({"type": "http.response.body", "body": frame, "more_body": True})
            await client.send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await self._send_error(client, err)
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

    def _replica_failed(self, replica: Replica, phase: str, detail: str) -> None:
        self.metrics.upstream_failures.labels(replica.model, phase).inc()
        self.balancer.eject(replica.id, time.monotonic() + self.config.eject_s)
        log.warning("replica %s of %s failed (%s): %s", replica.id, replica.model, phase, detail)

    def _snapshot_changed(self, before: Snapshot, after: Snapshot) -> None:
        # Called at every change of Consul's: set differences, not a walk over the fleet.
        for replica_id in before.by_id.keys() - after.by_id.keys() if before.by_id is not after.by_id else ():
            replica = before.by_id[replica_id]
            self.balancer.forget(replica.model, replica_id)
            for path in PROXY_PATHS:
                self._urls.pop((replica.host, replica.port, path), None)
        if before.models is after.models:
            return
        for model in after.models.keys() - self._seen_models:
            self.metrics.ensure_model(model)
            self._seen_models.add(model)

    # -- the read-only endpoints --------------------------------------------------------------------

    def models_listing(self) -> dict[str, Any]:
        return views.models_listing(self.discovery.snapshot, self.activator.in_flight)

    def health(self) -> tuple[int, dict[str, Any]]:
        return views.health(self.discovery, self.config.consul.addr)

    def _replica_counts(self) -> list[tuple[str, str, int]]:
        return views.replica_counts(self.discovery.snapshot, self.balancer.ejected(time.monotonic()))


def create_app(config: RouterConfig, *, activation: bool = True) -> RouterApp:
    return RouterApp(config, activation=activation)
