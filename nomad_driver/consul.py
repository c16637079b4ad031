"""A small async Consul client for the parts llmgw uses: KV with check-and-set, fenced
transactions, sessions, blocking health reads and catalog entries for external nodes.

Written on httpx rather than py-consul because the watcher needs what py-consul hides: the
index as a number, a timeout that outlasts a blocking query's wait, the `Errors` of a rolled
back transaction, and the ACL token on every call including `/v1/txn`. It speaks only the API
that Consul 1.8 and current releases share.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from nomad_driver.blocking import next_index


class ConsulError(Exception):
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
    addr = os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500")
    if "://" not in addr:
        ssl = os.environ.get("CONSUL_HTTP_SSL", "").lower() in ("1", "true")
        addr = f"{'https' if ssl else 'http'}://{addr}"
    return addr.rstrip("/")


class Consul:
    def __init__(
        self,
        addr: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.addr = (addr or _addr_from_env()).rstrip("/")
        if "://" not in self.addr:
            self.addr = f"http://{self.addr}"
        token = token if token is not None else os.environ.get("CONSUL_HTTP_TOKEN", "")
        headers = {"X-Consul-Token": token} if token else {}
        verify: bool | str = os.environ.get("CONSUL_CACERT") or True
        cert = None
        if os.environ.get("CONSUL_CLIENT_CERT") and os.environ.get("CONSUL_CLIENT_KEY"):
            cert = (os.environ["CONSUL_CLIENT_CERT"], os.environ["CONSUL_CLIENT_KEY"])
        self.timeout = timeout
        # Blocking reads hold a connection for their whole wait; a pool of their own keeps them
        # from starving the short writes the leader must make in time.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        self._http = httpx.AsyncClient(
            base_url=self.addr, headers=headers, verify=verify, cert=cert, timeout=timeout, limits=limits
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        content: bytes | None = None,
        wait_s: float | None = None,
        ok: Sequence[int] = (200,),
    ) -> httpx.Response:
        timeout = self.timeout + (wait_s * 1.1 if wait_s else 0.0)
        try:
            resp = await self._http.request(
                method,
                path,
                params=dict(params or {}),
                json=body if content is None else None,
                content=content,
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            raise ConsulUnavailable(f"consul {method} {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in ok:
            return resp
        text = resp.text.strip()[:300]
        if resp.status_code >= 500:
            raise ConsulUnavailable(f"consul {method} {path}: HTTP {resp.status_code}: {text}")
        raise ConsulError(f"consul {method} {path}: HTTP {resp.status_code}: {text}")

    @staticmethod
    def _index(resp: httpx.Response, previous: int) -> int:
        return next_index(previous, resp.headers.get("X-Consul-Index"))

    @staticmethod
    def _json(resp: httpx.Response, what: str) -> Any:
        try:
            return resp.json()
        except ValueError as exc:
            raise ConsulUnavailable(f"consul {what}: answer is not JSON: {resp.text[:200]!r}") from exc

    # KV

    async def kv_get(
        self, key: str, *, recurse: bool = False, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, list[KVEntry]]:
        params: dict[str, Any] = {}
        if recurse:
            params["recurse"] = "true"
        if index and wait_s:
            params["index"] = index
            params["wait"] = f"{int(wait_s)}s"
        resp = await self._call(
            "GET", f"/v1/kv/{key}", params=params, wait_s=wait_s if index else None, ok=(200, 404)
        )
        new_index = self._index(resp, index)
        if resp.status_code == 404:
            return new_index, []
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
        return new_index, entries

    async def kv_put(
        self,
        key: str,
        value: bytes | str,
        *,
        cas: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
    ) -> bool:
        params: dict[str, Any] = {}
        if cas is not None:
            params["cas"] = cas
        if acquire:
            params["acquire"] = acquire
        if release:
            params["release"] = release
        data = value.encode() if isinstance(value, str) else value
        resp = await self._call("PUT", f"/v1/kv/{key}", params=params, content=data)
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
        if resp.status_code == 200:
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
        if resp.status_code == 404:
            return False
        data = self._json(resp, "session renew")
        return isinstance(data, list) and bool(data)

    async def session_destroy(self, session: str) -> None:
        await self._call("PUT", f"/v1/session/destroy/{session}")

    # Health and catalog

    async def health_service(
        self, service: str, *, index: int = 0, wait_s: float | None = None, passing: bool = False
    ) -> tuple[int, list[dict[str, Any]]]:
        params: dict[str, Any] = {}
        if passing:
            params["passing"] = "true"
        if index and wait_s:
            params["index"] = index
            params["wait"] = f"{int(wait_s)}s"
        resp = await self._call(
            "GET", f"/v1/health/service/{service}", params=params, wait_s=wait_s if index else None
        )
        data = self._json(resp, f"health {service}")
        if not isinstance(data, list):
            raise ConsulUnavailable(f"consul health {service}: expected a list")
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
