"""The one Consul client of llmgw, shared by the watcher, the CLI and the router: KV with
check-and-set, fenced transactions, sessions, blocking health reads and catalog entries for
external nodes.

Async on aiohttp, the library the router's benchmark chose for its proxy, so the router's
discovery and the watcher make the same calls the same way (bench/router_bench.py). Not
py-consul, because llmgw needs what py-consul hides: the index as a number, a timeout that
outlasts a blocking query's wait, the `Errors` of a rolled back transaction, and the ACL token
on every call including `/v1/txn`. It speaks only the API that Consul 1.8 and current releases
share. Answers are read through `safeload.json_loads`, bounded, since a KV value anyone with
write access can set ends up in them.

Every failure is a `ConsulError`: `ConsulUnavailable` when Consul could not be reached, timed
out, failed on its side or answered garbage (retry later), a plain `ConsulError` when it
answered and refused (a bad request, a refused token).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from nomad_driver.blocking import ServiceError, next_index
from nomad_driver.endpoint import TLSConfigError, TLSSettings, consul_tls, normalise_addr, ssl_context
from nomad_driver.safeload import LoadError, json_loads

# A health or KV answer for a large fleet is tens of MiB; this only stops a runaway one.
ANSWER_MAX_BYTES = 256 * 1024 * 1024
# A Consul agent answers a connect in milliseconds; one that has not in 5 s is gone, and a
# blocking read should say so now, not when its minute-long wait would have ended.
CONNECT_TIMEOUT_S = 5.0


class ConsulError(ServiceError):
    """Consul answered, but not with what was asked for (a bad request, a refused token)."""


class ConsulUnavailable(ConsulError):
    """Consul could not be reached, timed out, or failed on its side (5xx); retry later."""


@dataclass(frozen=True)
class KVEntry:
    key: str
    value: bytes
    modify_index: int
    session: str = ""


@dataclass(frozen=True)
class TxnResult:
    ok: bool
    errors: tuple[str, ...] = ()
    # ModifyIndex of each KV entry the transaction wrote, by key.
    indexes: Mapping[str, int] = field(default_factory=dict)
    # The positions (Consul's `OpIndex`) of the operations that failed.
    failed_ops: tuple[int, ...] = ()
    # Where the transaction's `check-session` op sits, when it has one.
    session_check_op: int | None = None

    def failed_session_check(self) -> bool:
        """The lock was lost: told by the position of the failed op, never by its text, since a
        key or a model name can say "session" too and a plain CAS conflict is no lost lock."""
        return self.session_check_op is not None and self.session_check_op in self.failed_ops


def _addr_from_env() -> str:
    return normalise_addr(
        os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500"), os.environ.get("CONSUL_HTTP_SSL", "")
    )


def _ssl_context_for(addr: str, tls: TLSSettings) -> ssl.SSLContext | None:
    try:
        return ssl_context(addr, tls)
    except TLSConfigError as exc:
        raise TLSConfigError(f"CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY: {exc}") from None


def _blocking(index: int, wait_s: float | None) -> dict[str, Any]:
    """A blocking read's parameters: none for the first read (index 0), which answers at once."""
    return {"index": index, "wait": f"{int(wait_s)}s"} if index and wait_s else {}


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    index: str | None  # X-Consul-Index

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self, what: str = "") -> Any:
        """The body as JSON, bounded (LoadError when it is not)."""
        return json_loads(self.body, f"consul {what}", max_bytes=ANSWER_MAX_BYTES)


def _let_go_of(http: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop) -> None:
    """Close a session from outside a coroutine: in its own loop while that runs, else at once
    (a loop that has stopped takes its sockets with it; nothing there is left to wait for)."""
    if http.closed:
        return
    if loop.is_running():
        with contextlib.suppress(RuntimeError):  # closed in the meantime
            loop.call_soon_threadsafe(lambda: loop.create_task(http.close()))
        return
    connector = http.connector
    http.detach()
    if connector is not None:
        # close() drops every connection before it returns; what it returns is only the wait
        # for their goodbyes, which no loop will run. Stepping it once marks it awaited.
        closing = connector.close()
        with contextlib.suppress(StopIteration, RuntimeError):
            closing.__await__().send(None)


class Consul:
    """Address, token and TLS default to Consul's own variables (`CONSUL_HTTP_ADDR`,
    `CONSUL_HTTP_TOKEN`, `CONSUL_CACERT`, ...). Usable from any event loop: the HTTP session is
    made on first use in the loop that uses it."""

    def __init__(
        self,
        addr: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 64,
        server_name: str | None = None,
    ) -> None:
        self.addr = normalise_addr(addr) if addr else _addr_from_env()
        tls = consul_tls()
        # CONSUL_TLS_SERVER_NAME: the name Consul's certificate is verified against when the
        # address is not one of its names (a node IP, consul.service.consul).
        self.server_name = (server_name if server_name is not None else tls.server_name) or None
        token = token if token is not None else os.environ.get("CONSUL_HTTP_TOKEN", "")
        self._headers = {"X-Consul-Token": token} if token else {}
        self._ssl = ssl_context if ssl_context is not None else _ssl_context_for(self.addr, tls)
        self.timeout = timeout
        # Blocking reads hold a connection for their whole wait; a pool of their own keeps them
        # from starving the short writes the leader must make in time.
        self.max_connections = max_connections
        # Seconds the last `kv_changes` or `health_changes` spent decoding what changed, on the
        # event loop: set before it returns, with no await between, so its caller reads its own.
        self.last_decode_s = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._loop is not loop:
            # A session belongs to the loop it was made in; a CLI verb that runs a second loop
            # (or a test's thread) gets its own, and the old one is let go of in its own loop.
            self._let_go()
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(
                    ssl=self._ssl if self._ssl is not None else False,
                    limit=self.max_connections,
                    limit_per_host=self.max_connections,
                ),
            )
            self._loop = loop
            # A client nobody closed (a watcher dropped without `close()`) still closes its
            # connections when it goes, quietly: aiohttp's own complaint is a traceback printed
            # from the garbage collector, wherever it happens to run.
            self._finalizer = weakref.finalize(self, _let_go_of, self._http, loop)
        return self._http

    def _let_go(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _let_go_of once, and never again at collection
        self._http = self._loop = self._finalizer = None

    async def close(self) -> None:
        http, loop = self._http, self._loop
        if http is not None and loop is asyncio.get_running_loop():
            if self._finalizer is not None:
                self._finalizer.detach()
            self._http = self._loop = self._finalizer = None
            await http.close()
        else:
            self._let_go()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        content: bytes | None = None,
        wait_s: float | None = None,
        timeout: float | None = None,
        ok: Sequence[int] = (200,),
    ) -> Answer:
        # Consul adds up to wait/16 of jitter to a blocking wait; the client must outwait that.
        total = (timeout or self.timeout) + (wait_s * 1.1 if wait_s else 0.0)
        data = content if content is not None else json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if content is None and body is not None else None
        query = {k: str(v) for k, v in (params or {}).items()}
        try:
            async with self._session().request(
                method,
                f"{self.addr}{path}",
                params=query,
                data=data,
                headers=headers,
                allow_redirects=False,
                server_hostname=self.server_name if self._ssl is not None else None,
                timeout=aiohttp.ClientTimeout(total=total, sock_connect=min(CONNECT_TIMEOUT_S, total)),
            ) as resp:
                answer = Answer(resp.status, await resp.read(), resp.headers.get("X-Consul-Index"))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            detail = str(exc) or ("no answer in time" if isinstance(exc, TimeoutError) else "")
            raise ConsulUnavailable(
                f"consul {method} {path} at {self.addr}: {type(exc).__name__}: {detail}"
            ) from exc
        if answer.status in ok:
            return answer
        text = answer.text.strip()[:300]
        if answer.status >= 500:
            raise ConsulUnavailable(f"consul {method} {path}: HTTP {answer.status}: {text}")
        raise ConsulError(f"consul {method} {path}: HTTP {answer.status}: {text}")

    @staticmethod
    def _index(answer: Answer, previous: int) -> int:
        return next_index(previous, answer.index)

    @staticmethod
    def _json(answer: Answer, what: str) -> Any:
        try:
            return answer.json(what)
        except LoadError as exc:
            raise ConsulUnavailable(f"{exc}: {answer.body[:200]!r}") from exc

    # KV

    async def kv_get(
        self, key: str, *, recurse: bool = False, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, list[KVEntry]]:
        new_index, entries = await self.kv_changes(key, recurse=recurse, index=index, wait_s=wait_s)
        if entries is None:
            # Unchanged, and read again: a reader of `kv_get` always gets the entries.
            return await self.kv_get(key, recurse=recurse)
        return new_index, entries

    async def kv_changes(
        self, key: str, *, recurse: bool = False, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, list[KVEntry] | None]:
        """`kv_get` for a watch: None for a blocking read that ran out at the index it was given,
        whose answer (the whole prefix again, at ten thousand models megabytes of it) is not
        decoded, since the watch keeps what it read at that index."""
        params = _blocking(index, wait_s)
        if recurse:
            params["recurse"] = "true"
        resp = await self._call(
            "GET", f"/v1/kv/{key}", params=params, wait_s=wait_s if index else None, ok=(200, 404)
        )
        new_index = self._index(resp, index)
        self.last_decode_s = 0.0
        if index and new_index == index:
            return new_index, None
        if resp.status == 404:
            return new_index, []
        started = time.perf_counter()
        raw = self._json(resp, f"kv {key}")
        if not isinstance(raw, list):
            raise ConsulUnavailable(f"consul kv {key}: expected a list, got {type(raw).__name__}")
        entries = []
        for item in raw:
            if not isinstance(item, dict) or "Key" not in item:
                continue
            value = base64.b64decode(item["Value"]) if item.get("Value") else b""
            entries.append(
                KVEntry(
                    str(item["Key"]), value, int(item.get("ModifyIndex") or 0), str(item.get("Session") or "")
                )
            )
        self.last_decode_s = time.perf_counter() - started
        return new_index, entries

    async def kv_put(
        self,
        key: str,
        value: bytes | str,
        *,
        cas: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
        timeout: float | None = None,
    ) -> bool:
        params: dict[str, Any] = {}
        if cas is not None:
            params["cas"] = cas
        if acquire:
            params["acquire"] = acquire
        if release:
            params["release"] = release
        data = value.encode() if isinstance(value, str) else value
        resp = await self._call("PUT", f"/v1/kv/{key}", params=params, content=data, timeout=timeout)
        return resp.text.strip() == "true"

    async def kv_delete(self, key: str, *, recurse: bool = False, cas: int | None = None) -> bool:
        """False when `cas` is given and the key changed since (then nothing was deleted)."""
        params: dict[str, Any] = {}
        if recurse:
            params["recurse"] = "true"
        if cas is not None:
            params["cas"] = cas
        resp = await self._call("DELETE", f"/v1/kv/{key}", params=params)
        return resp.text.strip() != "false"

    async def txn(self, ops: list[dict[str, Any]]) -> TxnResult:
        """Atomic: all ops apply or none (409 with the reasons)."""
        if len(ops) > 64:
            raise ValueError("Consul 1.8 takes at most 64 operations in one transaction")
        resp = await self._call("PUT", "/v1/txn", body=ops, ok=(200, 409))
        body = self._json(resp, "txn")
        if resp.status == 200:
            indexes: dict[str, int] = {}
            results = body.get("Results") if isinstance(body, dict) else None
            for r in results or []:
                kv = r.get("KV") if isinstance(r, dict) else None
                if isinstance(kv, dict) and kv.get("Key"):
                    indexes[str(kv["Key"])] = int(kv.get("ModifyIndex") or 0)
            return TxnResult(True, indexes=indexes)
        errors = [
            e for e in (body.get("Errors") if isinstance(body, dict) else None) or [] if isinstance(e, dict)
        ]
        failed = tuple(e["OpIndex"] for e in errors if isinstance(e.get("OpIndex"), int))
        return TxnResult(False, tuple(str(e.get("What", e)) for e in errors), failed_ops=failed)

    async def fenced_put(self, key: str, value: bytes, *, cas: int, session: str, lock_key: str) -> TxnResult:
        """Write `key` only while `session` holds `lock_key` and nobody wrote `key` since `cas`.

        A deposed leader that has not noticed yet is refused here by Consul itself, so it can
        never overwrite what the new leader wrote."""
        ops: list[dict[str, Any]] = [
            {"KV": {"Verb": "check-session", "Key": lock_key, "Session": session}},
            {"KV": {"Verb": "cas", "Key": key, "Value": base64.b64encode(value).decode(), "Index": cas}},
        ]
        return replace(await self.txn(ops), session_check_op=0)

    # Sessions

    async def session_create(
        self, name: str, *, ttl_s: int, lock_delay_s: float, behavior: str = "release"
    ) -> str:
        body = {
            "Name": name,
            "TTL": f"{ttl_s}s",
            "LockDelay": f"{lock_delay_s}s",
            "Behavior": behavior,
            # No node checks: the agent's serfHealth says the agent is alive, not this process;
            # the TTL is what notices a dead watcher.
            "Checks": [],
        }
        resp = await self._call("PUT", "/v1/session/create", body=body)
        data = self._json(resp, "session create")
        if not isinstance(data, dict) or not data.get("ID"):
            raise ConsulUnavailable(f"consul session create: no ID in {data!r}")
        return str(data["ID"])

    async def session_renew(self, session: str) -> bool:
        """False when the session is gone (expired, destroyed, or Consul lost its state)."""
        resp = await self._call("PUT", f"/v1/session/renew/{session}", ok=(200, 404))
        if resp.status == 404:
            return False
        data = self._json(resp, "session renew")
        return isinstance(data, list) and bool(data)

    async def session_destroy(self, session: str) -> None:
        await self._call("PUT", f"/v1/session/destroy/{session}")

    # Health and catalog

    async def health_service(
        self, service: str, *, index: int = 0, wait_s: float | None = None, passing: bool = False
    ) -> tuple[int, list[dict[str, Any]]]:
        new_index, entries = await self.health_changes(service, index=index, wait_s=wait_s, passing=passing)
        if entries is None:
            return await self.health_service(service, passing=passing)
        return new_index, entries

    async def health_changes(
        self, service: str, *, index: int = 0, wait_s: float | None = None, passing: bool = False
    ) -> tuple[int, list[dict[str, Any]] | None]:
        """`health_service` for a watch: None for a blocking read that ran out unchanged (as
        `kv_changes`)."""
        params = _blocking(index, wait_s)
        if passing:
            params["passing"] = "true"
        resp = await self._call(
            "GET", f"/v1/health/service/{service}", params=params, wait_s=wait_s if index else None
        )
        self.last_decode_s = 0.0
        if index and self._index(resp, index) == index:
            return index, None
        started = time.perf_counter()
        data = self._json(resp, f"health {service}")
        if not isinstance(data, list):
            raise ConsulUnavailable(f"consul health {service}: expected a list")
        entries = [e for e in data if isinstance(e, dict)]
        self.last_decode_s = time.perf_counter() - started
        return self._index(resp, index), entries

    async def read_list(
        self,
        path: str,
        *,
        index: int = 0,
        wait_s: float | None = None,
        params: Mapping[str, str] | None = None,
    ) -> tuple[int, list[dict[str, Any]]]:
        """A read answered by a JSON list of objects, blocking past `index`. The caller spells
        out the path, so the call (and the grant it needs) is found where it is made."""
        query: dict[str, Any] = {**_blocking(index, wait_s), **(params or {})}
        resp = await self._call("GET", path, params=query, wait_s=wait_s if index else None)
        data = self._json(resp, path)
        if not isinstance(data, list):
            raise ConsulUnavailable(f"consul {path}: expected a list, got {type(data).__name__}")
        return self._index(resp, index), [e for e in data if isinstance(e, dict)]

    async def health_node(self, node: str) -> list[dict[str, Any]]:
        resp = await self._call("GET", f"/v1/health/node/{node}")
        data = self._json(resp, f"health node {node}")
        return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []

    async def catalog_register(self, body: dict[str, Any]) -> None:
        await self._call("PUT", "/v1/catalog/register", body=body)

    async def catalog_deregister(self, node: str, service_id: str | None = None) -> None:
        body: dict[str, Any] = {"Node": node}
        if service_id:
            body["ServiceID"] = service_id
        await self._call("PUT", "/v1/catalog/deregister", body=body)


def encode_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()
