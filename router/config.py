"""Router settings, from flags and the environment HashiCorp's own tools read.

Every upstream phase has its own timeout because the phases fail differently: a dead replica
refuses or drops a connection in milliseconds, while a healthy one may think for minutes before
its first token on a long prompt. One number for both would either hang requests on dead
replicas or cut off long prefills.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from nomad_driver.endpoint import client_ssl_context, consul_tls, normalise_addr

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_CONSUL = "http://127.0.0.1:8500"
ENGINE_SERVICE = "llmgw-engine"


POLICIES = ("affinity", "least-outstanding", "round-robin")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the flag or variable."""


@dataclass(frozen=True)
class Timeouts:
    # Connecting is local-network work; a replica that has not accepted in 3 s is gone or
    # wedged, and the request is better retried on another one while nothing was sent.
    connect_s: float = 3.0
    # Until the response starts (headers, and for a stream the first event): a long prompt's
    # prefill on a busy replica takes minutes, so this is generous on purpose.
    first_byte_s: float = 600.0
    # Between two chunks of a stream once it flows: decoding emits a token every few
    # milliseconds, so a two-minute silence is a hung engine, not a slow one.
    between_chunks_s: float = 120.0
    # How long a request waits for the leading watcher's answer to its ask (the attempt with
    # Nomad's evaluation): a pass and a scheduler answer take well under a second, so 30 s
    # without one means no watcher leads or it cannot reach Nomad.
    evaluation_s: float = 30.0
    # A client's request head (request line and headers) must arrive within this of its first
    # byte, or of the connection opening; one that dribbles a byte a second, or sends nothing,
    # is what exhausts file descriptors (slowloris). Real clients send a head in one packet.
    request_head_s: float = 10.0
    # Each read of a request body must bring something within this; a slow chunked body holds
    # a connection and a task for as long as the client likes otherwise.
    body_read_s: float = 30.0
    # The whole body, from the end of its head: a byte every 29 s passes every read's deadline
    # and would hold its connection for ever. An 8 MiB body needs 140 KB/s to make it; a chat
    # request is one packet.
    request_body_s: float = 60.0
    # The most a request waits for room on a replica (every ready one at `max_per_replica`)
    # before it is answered 503 `replicas_busy`; Envoy answers at once, which turns a burst of a
    # second into errors, and an unbounded wait (the old 1,024-connection pool) answered nothing.
    pool_wait_s: float = 10.0
    # One write to a client: a client that stops reading for this long is dropped and its
    # replica's request cancelled. Until then the stream is read ahead of it (router/proxy.py),
    # so the engine is not held waiting, but it does generate for the stalled client until the
    # answer ends or this runs out. nginx's send_timeout is 60 s. Env LLMGW_ROUTER_CLIENT_SEND_S.
    client_send_s: float = 30.0


@dataclass(frozen=True)
class Limits:
    # Chat requests with long contexts are a few hundred KiB of JSON; 8 MiB leaves room for
    # embeddings batches while keeping one client from holding the router's memory.
    max_body_bytes: int = 8 * 1024 * 1024
    # Request line and headers together, enforced while they arrive (see router/server.py).
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    # Requests in flight to one replica, and so its upstream connections: an engine serves a
    # handful at once and queues the rest, so past this the queue is better held here, bounded
    # (`Timeouts.pool_wait_s`), where it can move to another replica or be refused plainly.
    # Per replica, so one busy model never holds a connection another model needs.
    max_per_replica: int = 256
    # Open client connections; past it, for each new one, the one idle or sending its body
    # slowly the longest is closed (router/server.py). 0 means
    # "from the file descriptor limit": each proxied request also holds one upstream socket.
    max_connections: int = 0


@dataclass(frozen=True)
class ConsulSettings:
    addr: str = DEFAULT_CONSUL
    token: str = ""
    cacert: str = ""
    client_cert: str = ""
    client_key: str = ""
    # CONSUL_HTTP_SSL_VERIFY=false, as the consul CLI reads it (nomad_driver/endpoint.py). The
    # server name (CONSUL_TLS_SERVER_NAME) the Consul client reads itself.
    skip_verify: bool = False
    service: str = ENGINE_SERVICE
    # Consul caps a blocking wait at 10 minutes; under a minute keeps every HTTP timeout in
    # the chain (proxies, load balancers) from cutting a healthy watch.
    wait_s: float = 55.0

    def ssl_context(self) -> ssl.SSLContext | None:
        return client_ssl_context(
            self.addr, self.cacert, self.client_cert, self.client_key, skip_verify=self.skip_verify
        )


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    consul: ConsulSettings = field(default_factory=ConsulSettings)
    # Empty means no authentication: the router then trusts whatever network reaches it.
    api_keys: tuple[str, ...] = ()
    tls_cert: str = ""
    tls_key: str = ""
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    # Fallback definitions when `llmgw/config/models` is not in Consul.
    models_file: str = ""
    # Often enough that the watcher sees a model in use well inside any idle timeout, rarely
    # enough that a busy router writes a handful of keys per second, not one per request.
    activity_interval_s: float = 5.0
    # Affinity may put this many more requests in flight on a replica than the least loaded one
    # has, and then only within `balance_factor` of the average, before load wins.
    affinity_slack: int = 2
    balance_factor: float = 1.5
    # `affinity` (the above), `least-outstanding` (load only) or `round-robin` (neither): the
    # last two exist so that affinity's gain can be measured against them on real engines
    # (bench/affinity_bench.py), and as a way out should affinity misjudge a workload.
    # Env LLMGW_ROUTER_POLICY.
    policy: str = "affinity"
    # A replica that refused a connection or died mid-stream gets no new requests for this
    # long, bridging the second or two until its Consul check turns critical.
    eject_s: float = 5.0
    # Outlier ejection (router/outliers.py): this many 5xx or timeouts in a row take a replica
    # out for `outlier_base_s` times its ejections so far, at most `outlier_max_s`.
    outlier_consecutive: int = 5
    outlier_base_s: float = 30.0
    outlier_max_s: float = 300.0
    retry_after_s: int = 10
    # Requests that may wait for one model's replica at once (a cold start under load); past
    # it the answer is 429 `model_overloaded`. Env LLMGW_ROUTER_MAX_WAITING.
    max_waiting: int = 128
    # How often a streamed request that waits for a replica gets an SSE comment, so proxies
    # and clients with read timeouts do not give up on a cold start.
    keepalive_s: float = 5.0


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"listen address {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"listen address {value!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"listen address {value!r}: port {number} is out of range")
    return host.strip("[]"), number


def load_api_keys(path: str = "", env_value: str = "") -> tuple[str, ...]:
    """One key a line from the file (blank lines and `#` comments skipped), plus the
    comma-separated `LLMGW_API_KEYS`."""
    keys: list[str] = []
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--api-keys-file {path}: cannot read: {exc.strerror or exc}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
        if not keys:
            raise ConfigError(f"--api-keys-file {path}: no keys in it; remove the flag to disable auth")
    from_env = [k.strip() for k in env_value.split(",") if k.strip()]
    if env_value.strip() and not from_env:
        # `LLMGW_API_KEYS=" , "` is a mistake, not a wish to serve everyone without a key.
        raise ConfigError(
            "LLMGW_API_KEYS is set but holds no key (only commas and spaces); "
            "give comma-separated keys, or unset it to serve without authentication"
        )
    keys.extend(from_env)
    return tuple(dict.fromkeys(keys))


def consul_from_env(env: Mapping[str, str]) -> ConsulSettings:
    return ConsulSettings(
        addr=normalise_addr(env.get("CONSUL_HTTP_ADDR") or DEFAULT_CONSUL, env.get("CONSUL_HTTP_SSL", "")),
        token=env.get("CONSUL_HTTP_TOKEN", ""),
        cacert=env.get("CONSUL_CACERT", ""),
        client_cert=env.get("CONSUL_CLIENT_CERT", ""),
        client_key=env.get("CONSUL_CLIENT_KEY", ""),
        skip_verify=consul_tls(env).skip_verify,
    )


def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> RouterConfig:
    env = os.environ if env is None else env
    host, port = parse_listen(env.get("LLMGW_ROUTER_LISTEN") or DEFAULT_LISTEN)
    values: dict[str, object] = {
        "host": host,
        "port": port,
        "consul": consul_from_env(env),
        "api_keys": load_api_keys("", env.get("LLMGW_API_KEYS", "")),
    }
    if env.get("LLMGW_ROUTER_MAX_WAITING"):
        values["max_waiting"] = _positive_int("LLMGW_ROUTER_MAX_WAITING", env["LLMGW_ROUTER_MAX_WAITING"])
    if env.get("LLMGW_ROUTER_POLICY"):
        values["policy"] = env["LLMGW_ROUTER_POLICY"]
    if env.get("LLMGW_ROUTER_CLIENT_SEND_S"):
        send_s = _positive_seconds("LLMGW_ROUTER_CLIENT_SEND_S", env["LLMGW_ROUTER_CLIENT_SEND_S"])
        values["timeouts"] = replace(Timeouts(), client_send_s=send_s)
    values.update(overrides)
    if values.get("policy", "affinity") not in POLICIES:
        raise ConfigError(f"LLMGW_ROUTER_POLICY={values['policy']!r}: expected one of {', '.join(POLICIES)}")
    return RouterConfig(**values)  # type: ignore[arg-type]


def _positive_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a positive whole number") from None
    if number <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive whole number")
    return number


def _positive_seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a positive number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{name}={value!r}: expected a positive number of seconds")
    return seconds
