"""A small client for the llmgw admin API (served by the watcher), used by `llmgw ctl`.

Its errors are typed because the CLI maps each to its own exit code: unreachable, unknown
model, or an answer that is an error.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import httpx

from nomad_driver.admin_api import TOKEN_ENV

DEFAULT_ADMIN_ADDR = "http://127.0.0.1:4700"


class AdminUnreachable(Exception):
    def __init__(self, addr: str, detail: str) -> None:
        super().__init__(
            f"cannot reach the llmgw admin API at {addr}: {detail}; "
            "is `llmgw watcher` running? set LLMGW_ADMIN_ADDR"
        )


class UnknownModel(Exception):
    def __init__(self, model: str, addr: str) -> None:
        super().__init__(f"unknown model '{model}': the llmgw watcher at {addr} has no such model defined")
        self.model = model


class AdminError(Exception):
    """The admin API answered, but not with what was asked for (auth, server error, not JSON)."""


class NotLeader(AdminError):
    """A follower refused a change; it names the leader, or says that none leads right now."""

    def __init__(self, message: str, leader_id: str, leader_addr: str) -> None:
        super().__init__(message)
        self.leader_id = leader_id
        self.leader_addr = leader_addr


class AdminClient:
    """A small synchronous client for the admin API; `retry` and the read verbs share it."""

    def __init__(self, addr: str, token: str | None = None, timeout: float = 10.0) -> None:
        addr = addr.strip() or DEFAULT_ADMIN_ADDR
        self.addr = (addr if "://" in addr else f"http://{addr}").rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.addr, headers=headers, timeout=timeout)

    @classmethod
    def from_env(cls) -> AdminClient:
        return cls(os.environ.get("LLMGW_ADMIN_ADDR", DEFAULT_ADMIN_ADDR), os.environ.get(TOKEN_ENV))

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, model: str | None = None, body: Any = None) -> Any:
        """One admin API call. `model` names the model the path is about, so a 404 means that
        model is unknown rather than an endpoint this watcher lacks."""
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise AdminUnreachable(self.addr, str(exc) or type(exc).__name__) from exc
        if response.status_code == 404 and model is not None:
            raise UnknownModel(model, self.addr)
        if response.status_code == 409:
            leader = _leader_of(response)
            raise NotLeader(
                f"the llmgw watcher at {self.addr} does not lead: {_error_message(response)}",
                leader.get("id", ""),
                leader.get("address", ""),
            )
        if response.status_code >= 400:
            hint = f"; check {TOKEN_ENV}" if response.status_code in (401, 403) else ""
            raise AdminError(
                f"the llmgw admin API at {self.addr} answered {method} {path} with "
                f"{response.status_code}: {_error_message(response)}{hint}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise AdminError(
                f"the llmgw admin API at {self.addr} answered {method} {path} with something that is not JSON"
            ) from exc

    def get(self, path: str, *, model: str | None = None) -> Any:
        return self.request("GET", path, model=model)

    def post(self, path: str, *, model: str | None = None, body: Any = None) -> Any:
        return self.request("POST", path, model=model, body=body)

    def models_response(self) -> dict[str, Any]:
        """`GET /v1/admin/models` as sent: `models` plus whatever else the watcher adds."""
        data = self.get("/v1/admin/models")
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            raise AdminError(f"the llmgw admin API at {self.addr} sent a model list without 'models'")
        return data

    def models(self) -> list[dict[str, Any]]:
        return [m for m in self.models_response()["models"] if isinstance(m, dict)]

    def model(self, name: str) -> dict[str, Any]:
        data = self.get(f"/v1/admin/models/{quote(name, safe='')}", model=name)
        if not isinstance(data, dict):
            raise AdminError(
                f"the llmgw admin API at {self.addr} sent something other than a model for '{name}'"
            )
        return data

    def nodes(self) -> list[dict[str, Any]]:
        return self._list("/v1/admin/nodes", "nodes")

    def replicas(self) -> list[dict[str, Any]]:
        return self._list("/v1/admin/replicas", "replicas")

    def _list(self, path: str, key: str) -> list[dict[str, Any]]:
        data = self.get(path)
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise AdminError(f"the llmgw admin API at {self.addr} answered {path} without '{key}'")
        return [item for item in data[key] if isinstance(item, dict)]

    def retry(self, name: str) -> dict[str, Any]:
        """Unpark `name` (leader only: a follower's 409 names the leader, as `NotLeader`)."""
        data = self.post(f"/v1/admin/models/{quote(name, safe='')}/retry", model=name)
        return data if isinstance(data, dict) else {}

    def summary(self) -> dict[str, Any]:
        data = self.get("/v1/admin/summary")
        if not isinstance(data, dict):
            raise AdminError(f"the llmgw admin API at {self.addr} sent a summary that is not an object")
        return data

    def at(self, addr: str) -> AdminClient:
        """A client for another watcher with the same token and timeout; an address without a
        scheme (HOST:PORT, as watchers advertise) keeps this client's scheme."""
        if "://" not in addr:
            addr = f"{self.addr.split('://', 1)[0]}://{addr}"
        token = self._http.headers.get("Authorization", "").removeprefix("Bearer ") or None
        return AdminClient(addr, token, timeout=self._http.timeout.read or 10.0)


# A leadership change while following can move the leader once more; past that, something is
# wrong that following will not fix.
MAX_LEADER_HOPS = 3


def retry_on_leader(client: AdminClient, name: str) -> tuple[dict[str, Any], str]:
    """Retry `name` on whichever watcher leads, following followers' answers to it. Returns the
    answer and the address of the watcher that did it. Raises NotLeader when no watcher leads or
    the leader advertises no address."""
    current = client
    try:
        for _ in range(MAX_LEADER_HOPS):
            try:
                return current.retry(name), current.addr
            except NotLeader as exc:
                if not exc.leader_addr or current.at(exc.leader_addr).addr == current.addr:
                    raise
                if current is not client:
                    current.close()
                current = current.at(exc.leader_addr)
        return current.retry(name), current.addr
    finally:
        if current is not client:
            current.close()


def _leader_of(response: httpx.Response) -> dict[str, str]:
    """The leader a follower's 409 names: its body's `leader`, else the X-Llmgw-Leader header."""
    try:
        body = response.json()
    except ValueError:
        body = None
    leader = body.get("leader") if isinstance(body, dict) else None
    if isinstance(leader, dict):
        return {k: str(v) for k, v in leader.items() if k in ("id", "address") and v}
    header = response.headers.get("X-Llmgw-Leader", "")
    return {"address": header} if header else {}


def _error_message(response: httpx.Response) -> str:
    # The documented body is {"error": "..."}; FastAPI's own {"detail": ...} is accepted too.
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)
    return response.text.strip()[:200]
