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

from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from nomad_driver.certs import register_cert_collector
from router import errors
from router import status as views
from router.activation import Activator
from router.activity import WAITING, ActivityRecorder
from router.client import STOPPED_READING, ClientConnection, ClientLeft
from router.config import RouterConfig
from router.discovery import Discovery, Snapshot
from router.errors import RouterError
from router.forwarding import PROXY_PATHS, Forwarder
from router.forwarding import send_error as send_router_error
from router.http import (
    ClientGone,
    parse_request_off_loop,
    read_body,
    read_headers,
    send_bytes,
    send_error,
    send_json,
)
from router.metrics import UNKNOWN_MODEL, DiscoveryCollector, RouterMetrics
from router.outliers import Outliers
from router.proxy import StreamBroken
from router.routing import Balancer
from router.upstream import Upstream

log = logging.getLogger("llmgw.router")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

CLIENT_CLOSED = 499
# This router's view of every replica, outlier ejections included (`llmgw ctl replicas --router`).
REPLICAS_PATH = "/v1/router/replicas"
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
        outliers = Outliers(
            consecutive=config.outlier_consecutive,
            base_s=config.outlier_base_s,
            max_s=config.outlier_max_s,
            connect_s=config.eject_s,
            on_eject=self._ejected,
        )
        self.balancer = Balancer(
            slack=config.affinity_slack,
            balance_factor=config.balance_factor,
            policy=config.policy,
            outliers=outliers,
        )
        self.discovery = Discovery(
            config.consul, models_file=config.models_file, on_change=self._snapshot_changed
        )
        self.upstream = Upstream(config.timeouts, config.limits)
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
        self.forwarder = Forwarder(
            config, self.balancer, self.discovery, self.upstream, self.activity, self.metrics
        )
        self._keys = tuple(k.encode() for k in config.api_keys)
        self._seen_models: set[str] = set()
        self.metrics.add_collector(
            DiscoveryCollector(
                self._replica_counts,
                self.discovery.watch_ages,
                lambda: self.discovery.consul_up,
                lambda: [(name, self.discovery.restarts[name]) for name in self.discovery.watches],
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
                elif path.startswith("/v1/models/"):
                    self._check_method(scope, "GET")
                    self._authenticate(scope)
                    await send_json(send, 200, self.model_entry(path[len("/v1/models/") :]))
                elif path == REPLICAS_PATH:
                    self._check_method(scope, "GET")
                    self._authenticate(scope)
                    await send_json(send, 200, {"replicas": self.replica_views()})
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
            request = await parse_request_off_loop(body)
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
            outcome.status = await self.forwarder.forward(
                client, path, model, body, request, session_header, arrived
            )
        except RouterError as err:
            outcome.status = err.status
            await send_router_error(client, err)
        except ClientGone:
            outcome.status = CLIENT_CLOSED
        except StreamBroken:
            # Re-raised so that the server drops the connection mid-body (see _respond).
            outcome.status = 502
            raise

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

    def _snapshot_changed(self, before: Snapshot, after: Snapshot) -> None:
        # Called at every change of Consul's: set differences, not a walk over the fleet.
        if before.by_key is not after.by_key:
            for key in before.by_key.keys() - after.by_key.keys():
                self.forwarder.forget(before.by_key[key])
        if before.replicas is not after.replicas:
            for model in before.replicas.keys() | after.replicas.keys():
                count = len(after.replicas.get(model, ()))
                if count != len(before.replicas.get(model, ())):
                    self.balancer.fleet_size(model, count)
        if before.models is after.models:
            return
        for model in after.models.keys() - self._seen_models:
            self.metrics.ensure_model(model)
            self._seen_models.add(model)

    # -- the read-only endpoints --------------------------------------------------------------------

    def models_listing(self) -> dict[str, Any]:
        return views.models_listing(self.discovery.snapshot, self.activator.in_flight)

    def model_entry(self, model: str) -> dict[str, Any]:
        snapshot = self.discovery.snapshot
        if model not in snapshot.known_models():
            raise errors.model_not_found(model, snapshot.known_models())
        return views.model_entry(model, snapshot, self.activator.in_flight(model))

    def replica_views(self) -> list[dict[str, Any]]:
        return views.replica_views(
            self.discovery.snapshot, self.balancer.outliers, self.balancer.outstanding, time.monotonic()
        )

    def health(self) -> tuple[int, dict[str, Any]]:
        return views.health(self.discovery, self.config.consul.addr)

    def _ejected(self, key: Any, reason: str, seconds: float) -> None:
        replica = self.discovery.snapshot.by_key.get(key)
        model = replica.model if replica is not None else UNKNOWN_MODEL
        self.metrics.ejections.labels(model, reason).inc()
        log.warning(
            "event=replica_ejected model=%s replica=%s reason=%s for_s=%g",
            model,
            replica.name if replica is not None else key,
            reason,
            seconds,
        )

    def _replica_counts(self) -> list[tuple[str, str, int]]:
        return views.replica_counts(self.discovery.snapshot, self.balancer.ejected(time.monotonic()))


def create_app(config: RouterConfig, *, activation: bool = True) -> RouterApp:
    return RouterApp(config, activation=activation)
