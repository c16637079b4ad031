"""Running the router under uvicorn, for `llmgw router`, with its client connections bounded.

uvicorn with httptools is the fastest server measured for the router, but it leaves three
attacks open (issue 13): it checks no size while a request head arrives (httptools joins a
header's pieces as they come, so one 64 MiB header held the event loop for seconds), it has
no deadline for a head or for a connection that sends nothing (slowloris: 20,000 such
connections used every file descriptor and health checks were reset), and no cap on open
connections. uvicorn's own knobs do not cover these: `h11_max_incomplete_event_size` only
applies to the slower h11 parser, `timeout_keep_alive` starts only after a first response, and
`limit_concurrency` answers 503 to new requests while the idle connections it counts stay open.

So the router serves through `GuardedProtocol`, httptools' protocol with a few lines around
it: bytes of a head are counted before the parser sees them, headers are counted as they are
parsed, a timer runs from a head's first byte (or the connection's opening) to its end, and
past the connection cap the oldest idle connection is closed for each new one, else the oldest
one whose body is arriving too slowly, so a client that sends a request now (a health check) is
served however many connections an attacker holds open without finishing a request. The cost
is one addition per read and one timer per request; bench/router_bench.py measures it
(docs/dev/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import ssl
import time
from collections import Counter
from dataclasses import replace
from typing import Any, ClassVar

import httptools
import uvicorn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from nomad_driver.logs import configure_logging
from router import tls_guard
from router.app import RouterApp
from router.config import ConfigError, Limits, RouterConfig, Timeouts, from_env, load_api_keys, parse_listen

log = logging.getLogger("llmgw.router.connections")

# Room for the request line and the separators on top of the headers' own bytes.
HEAD_SLACK_BYTES = 8 * 1024
# Sockets kept for everything but client connections (Consul watches, Nomad, logs), and the
# most connections the automatic cap allows: each proxied request also holds an upstream socket.
RESERVED_FDS = 128
AUTO_MAX_CONNECTIONS = 16384
# Dropped connections are logged at once, then summed up at most this often: under attack a
# line per connection would be the next problem.
DROP_LOG_INTERVAL_S = 30.0
# A body arriving slower than this, averaged over at least SLOW_BODY_WINDOW_S, may be dropped to
# make room past the cap. Clients send a chat request in one packet and upload at megabytes a
# second; a body sent a byte every 29 s passes every read deadline and is never idle, and
# without this, a few thousand of them made every newcomer, health checks included, a 503.
SLOW_BODY_BYTES_PER_S = 16 * 1024
SLOW_BODY_WINDOW_S = 1.0

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def auto_max_connections() -> int:
    """Half of what the file descriptor limit leaves (a client and an upstream socket per
    request), after raising the soft limit to the hard one as servers usually do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(16, min(AUTO_MAX_CONNECTIONS, (soft - RESERVED_FDS) // 2))


class ConnectionGuard:
    """What the connections of one server share: the limits, the idle connections oldest
    first, and the count of connections closed for each reason."""

    def __init__(
        self, limits: Limits, timeouts: Timeouts, max_connections: int, tls: ssl.SSLContext | None = None
    ) -> None:
        # Set when serving HTTPS: the guard runs the handshake itself (see GuardedProtocol).
        self.tls = tls
        self.max_header_bytes = limits.max_header_bytes
        self.max_head_bytes = limits.max_header_bytes + HEAD_SLACK_BYTES
        self.max_headers = limits.max_headers
        self.head_s = timeouts.request_head_s
        self.max_connections = max_connections
        # Each with the time it became idle (opened, or answered); insertion order is that order.
        self.idle: dict[GuardedProtocol, float] = {}
        # Connections whose head is in and whose body is still arriving, in the order their
        # bodies began.
        self.reading: dict[GuardedProtocol, None] = {}
        self.dropped: Counter[str] = Counter()
        self._unlogged: Counter[str] = Counter()
        self._logged_at = 0.0

    def note_drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self._unlogged[reason] += 1
        now = time.monotonic()
        if now - self._logged_at >= DROP_LOG_INTERVAL_S:
            counts = ", ".join(f"{n} {r}" for r, n in sorted(self._unlogged.items()))
            log.warning(
                "closed client connections: %s (limits: %d connections, %d-byte heads, %d headers, "
                "%gs per head; see docs/router.md, 'Connection limits')",
                counts,
                self.max_connections,
                self.max_header_bytes,
                self.max_headers,
                self.head_s,
            )
            self._unlogged.clear()
            self._logged_at = now

    def make_room(self, newcomer: GuardedProtocol) -> None:
        """Over the cap: close the connection that has held its place for nothing the longest,
        idle (opened or answered, no request since) or sending its body too slowly; refuse the
        newcomer only when every other connection is busy with a request (being answered, or
        sending its body at a client's speed). Oldest first across both, so that a client whose
        request is a moment from arriving is not dropped for an attacker's hour-old trickle."""
        now = time.monotonic()
        idle = next(((c, since) for c, since in self.idle.items() if c is not newcomer), None)
        slow = next((c for c in self.reading if c.body_rate(now) < SLOW_BODY_BYTES_PER_S), None)
        if idle is not None and (slow is None or idle[1] <= slow.body_started):
            del self.idle[idle[0]]
            idle[0].transport.close()
            self.note_drop("idle_over_cap")
            return
        if slow is not None:
            slow.refuse(
                408,
                "request_timeout",
                "the router is at its connection limit and this request's body was arriving too "
                f"slowly ({slow.body_bytes} bytes in {now - slow.body_started:.1f}s); "
                "send the whole body at once",
                reason="slow_body_over_cap",
            )
            return
        newcomer.refuse(503, "too_many_connections", "the router is at its connection limit; retry shortly")


# Left to the kernel, a connection's send buffer grows to 4 MiB (tcp_wmem), more than a whole
# streamed completion: a client that never reads then never blocks a write, the write deadline
# never fires, and its engine slot generates to the end for nobody. Fixed at this size (the
# kernel doubles it), a client that stops reading blocks the next write within a few hundred
# KiB, which the deadline then ends; tokens are a few KiB a second, so readers never notice.
CLIENT_SEND_BUFFER_BYTES = 64 * 1024


def bound_send_buffer(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_SEND_BUFFER_BYTES)


class GuardedProtocol(HttpToolsProtocol):
    """httptools' protocol with the head bounded in bytes, headers and time (see the module)."""

    guard: ClassVar[ConnectionGuard]
    # Between the TCP connection and the end of its TLS handshake (HTTPS only).
    handshaking = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        bound_send_buffer(transport)
        self._head_bytes = 0
        self._tail = b""
        self._header_count = 0
        self._in_head = True
        self._message_done = True
        # Requests read whole and answers finished on this connection: an answer whose request
        # is not yet whole was given before its body arrived.
        self._messages_read = 0
        self._answers = 0
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self.body_started = 0.0
        self.body_bytes = 0
        self.guard.idle[self] = time.monotonic()
        # From the opening: a connection that never sends a byte is closed like a slow head.
        self._head_timer = self.loop.call_later(self.guard.head_s, self._head_timed_out)
        if len(self.connections) > self.guard.max_connections:
            self.guard.make_room(self)
        if self.guard.tls is not None and not transport.is_closing():
            # HTTPS: the handshake is timed and counted as part of the head (router/tls_guard.py).
            self.handshaking = True
            self.early: list[bytes] = []
            transport.pause_reading()  # asyncio: no ClientHello for the HTTP parser; start_tls resumes
            self.loop.create_task(tls_guard.upgrade(self, transport, self.guard.tls, self.guard.head_s))

    def switch_to(self, transport: asyncio.BaseTransport) -> None:
        """After the handshake (router/tls_guard.py): answers go out through TLS, and what the
        TLS layer decrypted before now is read."""
        HttpToolsProtocol.connection_made(self, transport)  # type: ignore[arg-type]
        early, self.early = self.early, []
        for data in early:
            self.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.handshaking = False
        self.guard.idle.pop(self, None)
        self.guard.reading.pop(self, None)
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handshaking:
            # A ClientHello before start_tls took over, or requests decrypted before it
            # returned: passed on once it has (tls_guard.upgrade).
            self.early.append(data)
            if self.transport.get_protocol() is self:
                self.transport.pause_reading()
            return
        if self._refused:
            return
        if self._in_head and not self._head_bytes and not data.strip(b"\r\n"):
            # Empty lines between requests, or after a body: RFC 9112 (2.2) says to ignore them,
            # so they start no head and no timer.
            pass
        elif self._in_head:
            seen = self._head_bytes + len(data)
            if seen > self.guard.max_head_bytes:
                # Only now look for where the head ends: the body may follow it in this read.
                end = (self._tail + data).find(b"\r\n\r\n")
                if end < 0 or self._head_bytes - len(self._tail) + end > self.guard.max_head_bytes:
                    self.refuse(
                        431,
                        "headers_too_large",
                        f"the request head is over {self.guard.max_head_bytes} bytes; "
                        f"headers may take at most {self.guard.max_header_bytes}",
                    )
                    return
            self._head_bytes = seen
            self._tail = data[-3:]
            # A pipelined head that arrives while an answer is in flight is timed from the
            # answer's end (on_response_complete): the client is reading, not stalling.
            if self._head_timer is None and not self.responding:
                self._head_timer = self.loop.call_later(self.guard.head_s, self._head_timed_out)
        elif not self._message_done:
            self.body_bytes += len(data)
        # uvicorn's own data_received, except that a head refused above, in a parser callback,
        # is not also answered 400 and logged as an invalid request.
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refused:
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_message_begin(self) -> None:
        self._header_count = 0
        self._header_size = 0
        self._message_done = False
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_size += len(name) + len(value)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        self.guard.idle.pop(self, None)
        self.guard.reading[self] = None
        self.body_started = time.monotonic()
        self.body_bytes = 0
        guard = self.guard
        if self._header_count > guard.max_headers:
            self.refuse(
                431, "headers_too_large", f"{self._header_count} headers; at most {guard.max_headers}"
            )
        elif self._header_size > guard.max_header_bytes:
            self.refuse(
                431,
                "headers_too_large",
                f"{self._header_size} bytes of headers; at most {guard.max_header_bytes}",
            )
        if self._refused:
            # Stops the parser; data_received below answers nothing more (send_400_response).
            raise ConnectionRefusedError
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._message_done = True
        self._messages_read += 1
        self.guard.reading.pop(self, None)
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._answers += 1
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self._messages_read < self._answers:
            # Answered before its body was read (a refusal, a timeout): what is left of the
            # body would hold the connection open, so it is closed instead.
            self.transport.close()
            return
        if self.responding:
            # A pipelined request took over (uvicorn started it just now): not idle.
            return
        if self._in_head and self._head_bytes and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.guard.head_s, self._head_timed_out)
        self.guard.idle[self] = time.monotonic()

    @property
    def responding(self) -> bool:
        """An answer is in flight: the guard neither times a head nor counts the connection idle."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def send_400_response(self, msg: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        super().send_400_response(msg)

    def body_rate(self, now: float) -> float:
        """Bytes a second of the body so far, over at least SLOW_BODY_WINDOW_S: a body that has
        just begun is judged by what a second at that pace would bring."""
        return self.body_bytes / max(now - self.body_started, SLOW_BODY_WINDOW_S)

    def refuse(self, status: int, code: str, message: str, *, reason: str = "") -> None:
        """Answer with an OpenAI-style error and close the connection; counted as `reason`
        (the code unless given)."""
        if self._refused:
            return
        self._refused = True
        self._cancel_head_timer()
        self.guard.idle.pop(self, None)
        self.guard.reading.pop(self, None)
        self.guard.note_drop(reason or code)
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing() or self.responding:
            return
        if self._head_bytes:
            self.refuse(
                408,
                "request_timeout",
                f"the request head did not arrive within {self.guard.head_s:g}s; send it at once",
            )
        elif self.cycle is None:
            # Opened and never used: closed without an answer, as nginx does.
            self.guard.idle.pop(self, None)
            self.guard.note_drop("silent")
            self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


class GuardCollector(Collector):
    """Connections the guards closed, by reason, and the cap, in the router's /metrics."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        closed = CounterMetricFamily(
            "llmgw_router_connections_closed",
            "Client connections the router closed to protect itself, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(self.guard.dropped.items()):
            closed.add_metric([reason], count)
        cap = GaugeMetricFamily(
            "llmgw_router_max_connections",
            "Open client connections past which the one idle, or sending its body slowly, the longest is closed.",
        )
        cap.add_metric([], self.guard.max_connections)
        return [closed, cap]


def protocol_for(config: RouterConfig) -> type[GuardedProtocol]:
    """A protocol class bound to one server's limits (uvicorn builds it from the class alone)."""
    limit = config.limits.max_connections or auto_max_connections()
    alpn = getattr(GuardedProtocol, "alpn_protocols", None)
    tls = tls_guard.server_context(config.tls_cert, config.tls_key, alpn) if config.tls_cert else None
    guard = ConnectionGuard(config.limits, config.timeouts, limit, tls)
    return type("RouterProtocol", (GuardedProtocol,), {"guard": guard})


def uvicorn_config(app: Any, config: RouterConfig, *, log_level: str = "info") -> uvicorn.Config:
    """How the router is served, for `llmgw router` and for the tests that attack it."""
    protocol = protocol_for(config)
    if isinstance(app, RouterApp):
        app.metrics.add_collector(GuardCollector(protocol.guard))
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol,
        # No ssl_certfile: the guard does the TLS handshake (protocol.guard.tls).
        lifespan="on",
        log_level=log_level,
        # uvicorn's own lines go through the root logger, in the one llmgw format.
        log_config=None,
        # One line per request costs more than the proxying; the metrics count every request.
        access_log=False,
        # Clients such as the openai SDK keep connections open between calls.
        timeout_keep_alive=75,
    )


def build_config(
    *,
    listen: str,
    api_keys_file: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    models_file: str = "",
    max_body_bytes: int = Limits.max_body_bytes,
    first_byte_timeout_s: float = Timeouts.first_byte_s,
    max_connections: int = Limits.max_connections,
) -> RouterConfig:
    host, port = parse_listen(listen)
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both to serve HTTPS, or neither")
    for flag, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key), ("--models", models_file)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if max_body_bytes <= 0:
        raise ConfigError("--max-body-mib must be positive")
    if first_byte_timeout_s <= 0:
        raise ConfigError("--first-byte-timeout must be positive")
    if max_connections < 0:
        raise ConfigError("--max-connections must be positive, or 0 for the automatic cap")
    config = from_env()
    return replace(
        config,
        host=host,
        port=port,
        api_keys=load_api_keys(api_keys_file, os.environ.get("LLMGW_API_KEYS", "")),
        tls_cert=tls_cert,
        tls_key=tls_key,
        models_file=models_file,
        limits=replace(config.limits, max_body_bytes=max_body_bytes, max_connections=max_connections),
        timeouts=replace(config.timeouts, first_byte_s=first_byte_timeout_s),
    )


def serve(*, activation: bool = True, log_level: str = "info", **options: object) -> None:
    config = build_config(**options)  # type: ignore[arg-type]
    configure_logging(log_level)
    app = RouterApp(config, activation=activation)
    if not config.api_keys:
        logging.getLogger("llmgw.router").warning(
            "no API keys configured: anyone who can reach %s:%d can use every model", config.host, config.port
        )
    uvicorn.Server(uvicorn_config(app, config, log_level=log_level)).run()
