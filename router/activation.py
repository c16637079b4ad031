"""Bringing a model up for a request that found no ready replica.

The rule (DESIGN.md "Activation", and the note that followed the phi-4 incident): each request
for a model with no ready replica ignores the previous placement result and makes a fresh
attempt, a Nomad scale call, then waits for *that attempt's* evaluation, not for the whole
activation window. Nomad answers an evaluation in well under a second, so:

- not placed (the evaluation's `FailedTGAllocs`): the request is answered at once with Nomad's
  reason, and the client is told not to retry;
- placed: the request waits for a ready replica up to the model's activation window, then gets
  503 `model_loading` with `Retry-After`.

A model that was unplaceable an hour ago but fits now, because another model was scaled down,
is therefore served, not refused on a stale answer. Concurrent requests share one attempt (one
scale call, one evaluation), and a placed attempt is shared by everyone who arrives while its
replica is still loading; a failed attempt is never reused, so the next request asks Nomad again.
Parked models never get here: parking is the watcher's decision and only a definition change or
`llmgw ctl retry` lifts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from nomad_driver.blocking import next_index
from nomad_driver.spec import Model
from nomad_driver.state import activity_key
from router import errors
from router.config import NomadSettings, Timeouts
from router.discovery import ConsulUnavailable, Discovery
from router.errors import RouterError
from router.metrics import RouterMetrics

log = logging.getLogger("llmgw.router.activation")

EVAL_DONE = ("complete", "failed", "canceled")


@dataclass(frozen=True)
class AttemptResult:
    placed: bool
    reason: str = ""
    eval_id: str = ""
    error: RouterError | None = None
    finished: float = 0.0


class NomadError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NomadClient:
    """The three Nomad calls the router makes, on aiohttp so nothing blocks the event loop."""

    def __init__(self, settings: NomadSettings) -> None:
        self.settings = settings
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {"X-Nomad-Token": self.settings.token} if self.settings.token else {}
        self._http = aiohttp.ClientSession(
            base_url=self.settings.addr,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self.settings.ssl_context() or False, limit=16),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=70),
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _params(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        params = dict(extra or {})
        if self.settings.namespace:
            params["namespace"] = self.settings.namespace
        if self.settings.region:
            params["region"] = self.settings.region
        return params

    async def _call(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None
    ) -> tuple[Any, str | None]:
        if self._http is None:
            raise NomadError(0, "nomad client is not started")
        try:
            async with self._http.request(method, path, params=self._params(params), json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    # Nomad's errors are plain text, the message itself.
                    raise NomadError(resp.status, text.strip()[:500] or f"HTTP {resp.status}")
                return json.loads(text), resp.headers.get("X-Nomad-Index")
        except aiohttp.ClientError as exc:
            raise NomadError(0, f"cannot reach Nomad at {self.settings.addr}: {exc}") from exc
        except TimeoutError as exc:
            raise NomadError(0, f"Nomad at {self.settings.addr} did not answer {method} {path}") from exc

    async def job(self, job_id: str) -> Mapping[str, Any]:
        job, _ = await self._call("GET", f"/v1/job/{quote(job_id, safe='')}")
        return job if isinstance(job, dict) else {}

    async def scale(self, job_id: str, group: str, count: int, message: str) -> str:
        body = {"Count": count, "Target": {"Group": group}, "Message": message}
        reply, _ = await self._call("POST", f"/v1/job/{quote(job_id, safe='')}/scale", body=body)
        return str((reply or {}).get("EvalID") or "")

    async def evaluation(self, eval_id: str, index: int, wait_s: float) -> tuple[Mapping[str, Any], int]:
        params = {"index": str(index), "wait": f"{max(1, int(wait_s))}s"} if index else {}
        reply, header = await self._call("GET", f"/v1/evaluation/{quote(eval_id, safe='')}", params=params)
        try:
            new_index = int(header or 0)
        except ValueError:
            new_index = 0
        return (reply if isinstance(reply, dict) else {}), new_index


def summarize(failed_tg_allocs: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
    """Nomad's reason in the words the watcher uses everywhere else (imported when first needed,
    so the router starts without the control plane's modules loaded)."""
    from nomad_driver.placement import summarize_placement

    return summarize_placement(dict(failed_tg_allocs), job=dict(job) if job is not None else None)


class Activator:
    def __init__(
        self,
        nomad: NomadClient,
        discovery: Discovery,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        retry_after_s: int,
    ) -> None:
        self.nomad = nomad
        self.discovery = discovery
        self.metrics = metrics
        self.timeouts = timeouts
        self.retry_after_s = retry_after_s
        self._attempts: dict[str, asyncio.Task[AttemptResult]] = {}

    async def close(self) -> None:
        for task in self._attempts.values():
            task.cancel()
        await asyncio.gather(*self._attempts.values(), return_exceptions=True)
        self._attempts.clear()

    def in_flight(self, model: str) -> bool:
        task = self._attempts.get(model)
        return task is not None and not task.done()

    async def activate(self, model: Model, arrived: float) -> None:
        """Return once `model` has a ready replica, or raise the answer to give instead."""
        task = self._attempts.get(model.name)
        if task is None or not self._reusable(task, model):
            task = asyncio.create_task(self._attempt(model))
            self._attempts[model.name] = task
        # Shielded: one client giving up must not cancel the attempt the others are waiting on.
        result = await asyncio.shield(task)
        if result.error is not None:
            raise result.error
        if not result.placed:
            self.metrics.refusals.labels(model.name, "unplaceable").inc()
            raise errors.unplaceable(model.name, result.reason)
        window = model.activation_timeout_s
        remaining = window - (time.monotonic() - arrived)
        if remaining > 0 and await self.discovery.wait_ready(model.name, remaining):
            # Its replica came: the attempt is spent. Reused later, after the watcher scaled
            # the model back to zero, it would ask Nomad for nothing and wait out the window.
            if self._attempts.get(model.name) is task:
                del self._attempts[model.name]
            return
        raise errors.loading(model.name, window, self.retry_after_s)

    def _reusable(self, task: asyncio.Task[AttemptResult], model: Model) -> bool:
        if not task.done():
            return True
        if task.cancelled() or task.exception() is not None:
            return False
        result = task.result()
        # A placed attempt stands while its replica may still be loading; anything else is
        # stale the moment it is answered.
        return result.placed and time.monotonic() - result.finished < model.activation_timeout_s

    async def _attempt(self, model: Model) -> AttemptResult:
        try:
            result = await self._scale_and_evaluate(model)
        except NomadError as exc:
            self.metrics.activations.labels(model.name, "error").inc()
            log.warning("activation of %s failed: %s", model.name, exc)
            return AttemptResult(placed=False, error=_nomad_failure(model, exc), finished=time.monotonic())
        except Exception as exc:
            self.metrics.activations.labels(model.name, "error").inc()
            log.exception("activation of %s failed", model.name)
            return AttemptResult(
                placed=False,
                error=RouterError(
                    503,
                    "activation_failed",
                    f"activating model '{model.name}' failed: {exc}",
                    type_="server_error",
                ),
                finished=time.monotonic(),
            )
        self.metrics.activations.labels(model.name, "placed" if result.placed else "unplaceable").inc()
        if not result.placed:
            log.warning(
                "model %s is unplaceable (evaluation %s): %s", model.name, result.eval_id, result.reason
            )
        return result

    async def _scale_and_evaluate(self, model: Model) -> AttemptResult:
        # The watcher scales idle models down by this key; a model being activated is in use.
        try:
            await self.discovery.put_kv(activity_key(model.name), f"{time.time():.3f}")
        except ConsulUnavailable as exc:
            log.warning("could not record activity for %s before activation: %s", model.name, exc)

        job = await self.nomad.job(model.job_id)
        groups = job.get("TaskGroups") or []
        if not groups:
            raise NomadError(404, f"job {model.job_id} has no task group")
        group = groups[0]
        current = int(group.get("Count") or 0)
        # At least one, at least the minimum, never past the maximum; an already running count
        # is kept, and scaling to it still makes Nomad evaluate the job afresh.
        target = min(max(current, model.replicas_min, 1), max(model.replicas_max, 1))
        try:
            eval_id = await self.nomad.scale(
                model.job_id,
                str(group.get("Name") or ""),
                target,
                f"llmgw router: request for {model.name} with no ready replica",
            )
        except NomadError as exc:
            if exc.status == 400 and "active deployment" in str(exc):
                # A deployment is rolling the job out right now: its allocations are placed
                # and starting, which is what this attempt would have asked for.
                return AttemptResult(placed=True, finished=time.monotonic())
            raise
        if not eval_id:
            return AttemptResult(placed=True, finished=time.monotonic())
        evaluation = await self._wait_evaluation(eval_id)
        failed = evaluation.get("FailedTGAllocs") or {}
        if failed:
            return AttemptResult(
                placed=False, reason=summarize(failed, job), eval_id=eval_id, finished=time.monotonic()
            )
        if evaluation.get("Status") == "failed":
            raise NomadError(
                500, f"evaluation {eval_id} failed: {evaluation.get('StatusDescription') or 'no description'}"
            )
        return AttemptResult(placed=True, eval_id=eval_id, finished=time.monotonic())

    async def _wait_evaluation(self, eval_id: str) -> Mapping[str, Any]:
        deadline = time.monotonic() + self.timeouts.evaluation_s
        index = 0
        while True:
            started = time.monotonic()
            evaluation, returned = await self.nomad.evaluation(eval_id, index, min(deadline - started, 10.0))
            if evaluation.get("Status") in EVAL_DONE:
                return evaluation
            if time.monotonic() >= deadline:
                raise NomadError(
                    504,
                    f"evaluation {eval_id} still {evaluation.get('Status') or 'pending'} after "
                    f"{self.timeouts.evaluation_s:.0f}s",
                )
            index = next_index(index, returned)
            # A server that answers a blocking read at once must not turn this into a busy loop.
            if time.monotonic() - started < 0.05:
                await asyncio.sleep(0.05)


def _nomad_failure(model: Model, exc: NomadError) -> RouterError:
    if exc.status == 404:
        return RouterError(
            503,
            "model_not_deployed",
            f"model '{model.name}' has no Nomad job {model.job_id}: {exc}; run 'llmgw apply' with its definition",
            type_="model_unavailable",
            headers=errors.NO_RETRY,
        )
    return RouterError(
        503,
        "activation_failed",
        f"model '{model.name}' has no ready replica and asking Nomad to start one failed: {exc}",
        type_="server_error",
        headers=((b"retry-after", b"5"),),
    )
