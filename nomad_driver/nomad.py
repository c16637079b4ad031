"""The Nomad calls llmgw makes, over python-nomad, configured the way Nomad's own CLI is.

python-nomad's typed methods drop the `X-Nomad-Index` header and know nothing of scaling or
blocking queries, so those go through its generic `request()`; everything else uses the typed
calls. Every failure surfaces as `NomadUnavailable` (retry later: unreachable, timed out, 5xx,
an answer that is not JSON) or `NomadError` (Nomad refused: 4xx), so callers can tell "Nomad is
down" from "Nomad said no" and never park a model because their own call failed.

Calls are synchronous (requests); the watcher runs them in threads. Each thread gets its own
client, because a requests.Session is not meant to be shared across threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterable
from typing import Any

import nomad as pynomad
import requests
import requests.adapters
from nomad.api import exceptions as nomad_exc

from nomad_driver.blocking import ServiceError, next_index
from nomad_driver.endpoint import TLSConfigError, nomad_tls, normalise_addr

JOB_PREFIX = "llmgw-"


class NomadError(ServiceError):
    """Nomad answered and refused (4xx); the message is Nomad's own text."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NomadUnavailable(NomadError):
    """Nomad could not be reached, timed out, or failed on its side."""


def tls_from_env(address: str) -> tuple[bool | str, tuple[str, ...]]:
    """TLS settings the way Nomad's own CLI reads them (nomad_driver/endpoint.py): what to
    verify the server with (a CA file or directory, True for the system's CAs, False with
    NOMAD_SKIP_VERIFY) and the client pair for mutual TLS. Returns (verify, (cert, key) or ())."""
    tls = nomad_tls()
    verify: bool | str = tls.cacert or tls.capath or address.startswith("https://")
    if tls.skip_verify:
        verify = False
    if bool(tls.client_cert) != bool(tls.client_key):
        raise TLSConfigError("NOMAD_CLIENT_CERT and NOMAD_CLIENT_KEY go together: set both, or neither")
    return verify, ((tls.client_cert, tls.client_key) if tls.client_cert else ())


class _ServerNameAdapter(requests.adapters.HTTPAdapter):
    """Connections that send `server_name` as SNI and verify the certificate against it
    (NOMAD_TLS_SERVER_NAME): how the CLI reaches a server by an address its certificate lacks."""

    def __init__(self, server_name: str) -> None:
        self._server_name = server_name
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["server_hostname"] = self._server_name
        super().init_poolmanager(*args, **kwargs)


def nomad_session() -> requests.Session:
    """A requests session for Nomad, with NOMAD_TLS_SERVER_NAME applied."""
    session = requests.Session()
    server_name = nomad_tls().server_name
    if server_name:
        session.mount("https://", _ServerNameAdapter(server_name))
    return session


class Nomad:
    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        namespace: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.address = normalise_addr(address or os.environ.get("NOMAD_ADDR") or "http://127.0.0.1:4646")
        self.token = token if token is not None else os.environ.get("NOMAD_TOKEN")
        self.namespace = namespace or os.environ.get("NOMAD_NAMESPACE") or "default"
        self.verify, self.cert = tls_from_env(self.address)
        self.timeout = timeout
        self._local = threading.local()

    def client(self) -> pynomad.Nomad:
        c: pynomad.Nomad | None = getattr(self._local, "client", None)
        if c is None:
            c = pynomad.Nomad(
                address=self.address,
                token=self.token,
                namespace=self.namespace,
                timeout=self.timeout,
                verify=self.verify,
                cert=self.cert,
                session=nomad_session(),
            )
            self._local.client = c
        return c

    def _request(
        self,
        endpoint: str,
        *path: str,
        method: str = "get",
        params: dict[str, Any] | None = None,
        body: Any = None,
        timeout: float | tuple[float, float] | None = None,
        stream: bool = False,
    ) -> requests.Response:
        requester: Any = self.client()
        for part in endpoint.split("."):  # "client.stream_logs" is a nested requester
            requester = getattr(requester, part)
        params = dict(params or {})
        params.setdefault("namespace", self.namespace)
        where = "/".join((endpoint, *path))
        try:
            resp: requests.Response = requester.request(
                *path, method=method, params=params, json=body, timeout=timeout or self.timeout, stream=stream
            )
        except nomad_exc.BaseNomadException as exc:
            resp_obj = getattr(exc, "nomad_resp", None)
            status = getattr(resp_obj, "status_code", 0) or 0
            text = str(getattr(resp_obj, "text", "") or resp_obj or exc).strip()[:300]
            if isinstance(status, int) and 400 <= status < 500:
                raise NomadError(
                    f"nomad {method.upper()} /v1/{where}: HTTP {status}: {text}", status
                ) from exc
            answered = f"HTTP {status}: " if isinstance(status, int) and status else ""
            raise NomadUnavailable(f"nomad {method.upper()} /v1/{where}: {answered}{text}", status) from exc
        except (requests.RequestException, OSError) as exc:
            raise NomadUnavailable(
                f"nomad {method.upper()} /v1/{where}: {type(exc).__name__}: {exc}"
            ) from exc
        return resp

    @staticmethod
    def _json(resp: requests.Response, what: str) -> Any:
        try:
            return resp.json()
        except ValueError as exc:
            raise NomadUnavailable(f"nomad {what}: answer is not JSON: {resp.text[:200]!r}") from exc

    def request_json(
        self, endpoint: str, *path: str, what: str = "", method: str = "get", body: Any = None
    ) -> Any:
        """One call and its JSON answer, unread, for a call only one caller makes (the operator's
        plan, the watcher's node reads) and whose answer that caller checks itself. `what` names
        the call in errors."""
        resp = self._request(endpoint, *path, method=method, body=body)
        return self._json(resp, what or "/".join((endpoint, *path)))

    def blocking_list(
        self, collection: str, *, index: int = 0, wait_s: float = 60.0, params: dict[str, Any] | None = None
    ) -> tuple[int, list[dict[str, Any]]]:
        """`/v1/jobs`, `/v1/allocations` or `/v1/evaluations`, blocking until the index passes
        `index` (or `wait_s`). The returned index follows Consul's and Nomad's reset rules."""
        query = dict(params or {})
        if index:
            query["index"] = index
            query["wait"] = f"{int(wait_s)}s"
        # Nomad adds up to wait/16 of jitter; the client must outwait that.
        timeout = self.timeout + (wait_s * 1.1 if index else 0)
        resp = self._request(collection, params=query, timeout=timeout)
        data = self._json(resp, collection)
        if not isinstance(data, list):
            raise NomadUnavailable(f"nomad {collection}: expected a list, got {type(data).__name__}")
        return next_index(index, resp.headers.get("X-Nomad-Index")), [d for d in data if isinstance(d, dict)]

    def llmgw_jobs(self, *, index: int = 0, wait_s: float = 60.0) -> tuple[int, list[dict[str, Any]]]:
        return self.blocking_list("jobs", index=index, wait_s=wait_s, params={"prefix": JOB_PREFIX})

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        try:
            data = self._json(self._request("job", job_id), f"job {job_id}")
        except NomadError as exc:
            if exc.status == 404:
                return None
            raise
        return data if isinstance(data, dict) else None

    def register_job(self, job: dict[str, Any], *, enforce_index: int | None = None) -> dict[str, Any]:
        """Register (or update) a job. With `enforce_index`, only over the job version Nomad
        holds at that JobModifyIndex (0: only if no such job exists), as `nomad job run
        -check-index` does: a writer acting on an old view is refused, not obeyed."""
        body: dict[str, Any] = {"Job": job}
        if enforce_index is not None:
            body.update(EnforceIndex=True, JobModifyIndex=enforce_index)
        resp = self._request("job", str(job["ID"]), method="post", body=body)
        data = self._json(resp, f"register {job['ID']}")
        return data if isinstance(data, dict) else {}

    def scale(self, job_id: str, group: str, count: int, message: str) -> dict[str, Any]:
        """Scale through the scale endpoint, so the reason shows in `nomad job status` and the
        job's scaling events, not only in llmgw's logs."""
        body = {
            "Count": count,
            "Target": {"Job": job_id, "Group": group},
            "Message": message,
            "Meta": {"source": "llmgw"},
        }
        resp = self._request("job", job_id, "scale", method="post", body=body)
        data = self._json(resp, f"scale {job_id}")
        return data if isinstance(data, dict) else {}

    def stop_job(self, job_id: str) -> dict[str, Any]:
        """`nomad job stop` (not purged: its versions and allocations stay to be read, and
        registering it again runs it again)."""
        resp = self._request("job", job_id, method="delete")
        data = self._json(resp, f"stop {job_id}")
        return data if isinstance(data, dict) else {}

    def force_reschedule(self, job_id: str) -> dict[str, Any]:
        """`nomad job eval -force-reschedule`: Nomad replaces the job's failed allocations now,
        whatever their reschedule policy has left."""
        body = {"JobID": job_id, "EvalOptions": {"ForceReschedule": True}}
        resp = self._request("job", job_id, "evaluate", method="post", body=body)
        data = self._json(resp, f"evaluate {job_id}")
        return data if isinstance(data, dict) else {}

    def evaluation(self, eval_id: str, *, index: int = 0, wait_s: float = 10.0) -> tuple[int, dict[str, Any]]:
        """One evaluation, blocking until it changes past `index` (or `wait_s`): how the leader
        reads what Nomad made of an activation's scale call, at once."""
        query: dict[str, Any] = {}
        if index:
            query = {"index": index, "wait": f"{max(1, int(wait_s))}s"}
        timeout = self.timeout + (wait_s * 1.1 if index else 0)
        resp = self._request("evaluation", eval_id, params=query, timeout=timeout)
        data = self._json(resp, f"evaluation {eval_id}")
        return next_index(index, resp.headers.get("X-Nomad-Index")), data if isinstance(data, dict) else {}

    def job_evaluations(self, job_id: str) -> list[dict[str, Any]]:
        """`GET /v1/job/<id>/evaluations`: one job's evaluations, whole (`structs.Evaluation`,
        as `/v1/evaluations` lists them); none for a job Nomad no longer has."""
        try:
            data = self._json(self._request("job", job_id, "evaluations"), f"job {job_id} evaluations")
        except NomadError as exc:
            if exc.status == 404:
                return []
            raise
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []

    def stderr_tail(self, alloc_id: str, task: str, nbytes: int = 4096) -> str:
        """The last `nbytes` of a task's stderr: where an engine says why it died."""
        return self.log_tail(alloc_id, task, "stderr", nbytes)

    def log_tail(self, alloc_id: str, task: str, kind: str, nbytes: int = 4096) -> str:
        """The last `nbytes` of a task's stdout or stderr (a fetch's progress is on stdout)."""
        params = {"task": task, "type": kind, "origin": "end", "offset": nbytes, "plain": "true"}
        resp = self._request("client.stream_logs", alloc_id, params=params)
        return resp.content[-nbytes:].decode("utf-8", errors="replace")


# Nomad sends `{}` every 10 s on an idle stream; three missed heartbeats mean the stream is dead
# (a server that went away without closing it), not a quiet cluster.
EVENT_READ_TIMEOUT_S = 35.0


class EventStream:
    """One subscription to `/v1/event/stream`, read by a thread of its own, its frames handed to
    the event loop that opened it. Not python-nomad's `get_stream`: that reconnects silently from
    the index it was first given (replaying, or skipping what passed while it was away) and dies
    without a word on a read timeout; here any end of the stream is an error the reader sees, so
    it can read the collection again from a known index."""

    def __init__(self, nomad: Nomad, topics: Iterable[str], index: int) -> None:
        self._nomad = nomad
        self._topics = list(topics)
        self._index = index
        self._loop = asyncio.get_running_loop()
        self._frames: asyncio.Queue[dict[str, Any] | NomadError] = asyncio.Queue()
        self._closed = threading.Event()
        self._response: requests.Response | None = None
        self._failed: NomadError | None = None
        self._thread = threading.Thread(target=self._read, name="llmgw-nomad-events", daemon=True)
        self._thread.start()

    def _hand(self, item: dict[str, Any] | NomadError) -> None:
        if self._closed.is_set():
            return
        try:
            self._loop.call_soon_threadsafe(self._frames.put_nowait, item)
        except RuntimeError:  # the loop closed under a reader that was never closed
            self._closed.set()

    def _read(self) -> None:
        where = f"nomad GET /v1/event/stream?topic={','.join(self._topics)}"
        try:
            resp = self._nomad._request(
                "event.stream",
                params={"topic": self._topics, "index": self._index},
                timeout=(self._nomad.timeout, EVENT_READ_TIMEOUT_S),
                stream=True,
            )
            self._response = resp
            with resp:
                for line in resp.iter_lines():
                    if self._closed.is_set():
                        return
                    if not line:
                        continue
                    try:
                        frame = json.loads(line)
                    except ValueError:
                        raise NomadUnavailable(f"{where}: a frame that is not JSON: {line[:200]!r}") from None
                    if not isinstance(frame, dict):
                        raise NomadUnavailable(f"{where}: a frame that is not an object: {line[:200]!r}")
                    if frame:  # `{}` is a heartbeat
                        self._hand(frame)
            raise NomadUnavailable(f"{where}: the stream ended")
        except NomadError as exc:
            self._hand(exc)
        except Exception as exc:  # a reader closed under it fails in urllib3's own ways
            self._hand(NomadUnavailable(f"{where}: {type(exc).__name__}: {exc}"))

    async def next(self, wait_s: float) -> dict[str, Any] | None:
        """The next frame with events, or None when `wait_s` passes without one; raises
        NomadError once the stream has ended, for whatever reason."""
        if self._failed is not None:
            raise self._failed
        try:
            async with asyncio.timeout(wait_s):
                item = await self._frames.get()
        except TimeoutError:
            return None
        if isinstance(item, NomadError):
            self._failed = item
            raise item
        return item

    def pending(self) -> list[dict[str, Any]]:
        """The frames already here, without waiting. An end of the stream behind them is kept
        for the next `next()`, so the frames before it are still applied."""
        out: list[dict[str, Any]] = []
        while self._failed is None and not self._frames.empty():
            item = self._frames.get_nowait()
            if isinstance(item, NomadError):
                self._failed = item
            else:
                out.append(item)
        return out

    def close(self) -> None:
        # The reader thread notices at its next line. Closing the response from here would wait
        # for the reader's lock, held across its read until the next heartbeat (10 s on Nomad),
        # and stall the event loop that long; shutting the socket down ends that read at once.
        self._closed.set()
        response = self._response
        if response is None:
            return
        sock = getattr(getattr(response.raw, "connection", None), "sock", None)
        if sock is not None:
            # A socket already dead answers with an error; either way the read is over.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return
        threading.Thread(target=self._close_quietly, args=(response,), daemon=True).start()

    @staticmethod
    def _close_quietly(response: requests.Response) -> None:
        with contextlib.suppress(Exception):
            response.close()
