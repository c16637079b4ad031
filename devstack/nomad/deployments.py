"""Deployments as Nomad makes them: one per job version for service groups with an update
strategy (`scheduler/reconciler/reconcile_cluster.go` `createDeployment`), their counts kept by
the state store as allocations are placed and found healthy (`state.py`, as `state_store.go`
`updateDeploymentWithAlloc`), allocation health from checks or task states within
`min_healthy_time` and `healthy_deadline` (`client/allochealth`), and the watcher that completes,
fails and re-evaluates them (`nomad/deploymentwatcher`).

It matters to llmgw because `Job.Scale` refuses a job whose latest deployment is active ("job
scaling blocked due to active deployment"), and Nomad gives every service job an update strategy
unless it says `max_parallel = 0`: a stand-in without deployments hid that from every test.

Not modelled: canaries (promote answers as for a deployment without any), auto-revert and
auto-promote, multiregion states, rescheduling held back inside an active deployment (the
watcher allows replacements of unhealthy allocations at once when a progress deadline is set,
which is the default, so the outcome is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

from devstack.nomad.clock import Clock
from devstack.nomad.deployment_status import ACTIVE as ACTIVE
from devstack.nomad.deployment_status import CANCELLED as CANCELLED
from devstack.nomad.deployment_status import FAILED as FAILED
from devstack.nomad.deployment_status import PAUSED as PAUSED
from devstack.nomad.deployment_status import RUNNING as RUNNING
from devstack.nomad.deployment_status import SUCCESSFUL as SUCCESSFUL
from devstack.nomad.deployment_status import TABLE as TABLE
from devstack.nomad.deployment_status import has_health, is_active
from devstack.nomad.encode import ZERO_TIME, parse_rfc3339_ns, rfc3339
from devstack.nomad.state import StateStore

Json = dict[str, Any]
log = logging.getLogger("devstack.nomad.deployments")


DESC_RUNNING = "Deployment is running"
DESC_PAUSED = "Deployment is paused"
DESC_SUCCESSFUL = "Deployment completed successfully"
DESC_STOPPED_JOB = "Cancelled because job is stopped"
DESC_NEWER_JOB = "Cancelled due to newer version of job"
DESC_FAILED_ALLOCS = "Failed due to unhealthy allocations"
DESC_PROGRESS_DEADLINE = "Failed due to progress deadline"
DESC_FAILED_BY_USER = "Deployment marked as failed"

# nomad/structs/errors.go
ERR_NO_FAIL = "can't fail terminal deployment"
ERR_NO_PAUSE = "can't pause terminal deployment"
ERR_NO_RESUME = "can't resume terminal deployment"
ERR_NO_PROMOTE = "can't promote terminal deployment"
ERR_SCALE_BLOCKED = "job scaling blocked due to active deployment"

# How often the client's health trackers and the deployment watcher look again, in real time:
# Consul runs its checks on real time, and a finer poll only costs CPU.
POLL_REAL_SECONDS = 0.2


def update_strategy(group: Json | None) -> Json | None:
    """The group's update strategy when it asks for deployments (`UpdateStrategy.IsEmpty` is
    `MaxParallel == 0`): `max_parallel = 0` is how a job opts out."""
    update = (group or {}).get("Update")
    if not update or int(update.get("MaxParallel") or 0) <= 0:
        return None
    return update


def latest_for_job(store: StateStore, namespace: str, job_id: str) -> Json | None:
    """`LatestDeploymentByJobID`: the one created last."""
    found = store.deployments_for_job(namespace, job_id)
    return max(found, key=lambda d: d["CreateIndex"]) if found else None


def scale_blocked(store: StateStore, job: Json) -> bool:
    """`Job.Scale` refuses while the job's latest deployment is active (any version of this job,
    not of an earlier job with the same ID)."""
    latest = latest_for_job(store, job["Namespace"], job["ID"])
    return is_active(latest) and latest is not None and latest["JobCreateIndex"] == job["CreateIndex"]


def new_deployment(job: Json, priority: int, now_ns: int) -> Json:
    """`structs.NewDeployment`, every field of `structs.Deployment`."""
    return {
        "ID": str(uuid.uuid4()),
        "Namespace": job["Namespace"],
        "JobID": job["ID"],
        "JobVersion": job["Version"],
        "JobModifyIndex": job["ModifyIndex"],
        "JobSpecModifyIndex": job["JobModifyIndex"],
        "JobCreateIndex": job["CreateIndex"],
        "IsMultiregion": False,
        "TaskGroups": {},
        "Status": RUNNING,
        "StatusDescription": DESC_RUNNING,
        "EvalPriority": priority,
        "CreateIndex": 0,
        "ModifyIndex": 0,
        "CreateTime": now_ns,
        "ModifyTime": now_ns,
    }


def new_group_state(strategy: Json, desired_total: int) -> Json:
    """`structs.DeploymentState` for one group."""
    return {
        "AutoRevert": bool(strategy.get("AutoRevert")),
        "AutoPromote": bool(strategy.get("AutoPromote")),
        "ProgressDeadline": int(strategy.get("ProgressDeadline") or 0),
        "RequireProgressBy": ZERO_TIME,
        "Promoted": False,
        "PlacedCanaries": None,
        "DesiredCanaries": 0,
        "DesiredTotal": desired_total,
        "PlacedAllocs": 0,
        "HealthyAllocs": 0,
        "UnhealthyAllocs": 0,
    }


def with_status(deployment: Json, status: str, description: str, now_ns: int) -> Json:
    return {**deployment, "Status": status, "StatusDescription": description, "ModifyTime": now_ns}


def promoted(state: Json, now_ns: int) -> Json:
    """A group's state once promoted: a progress deadline already running starts over."""
    out = {**state, "Promoted": True}
    deadline = int(state.get("ProgressDeadline") or 0)
    if deadline and parse_rfc3339_ns(state.get("RequireProgressBy")):
        out["RequireProgressBy"] = rfc3339(now_ns + deadline)
    return out


# ----- the scheduler's part --------------------------------------------------------------------


def current_for_job(store: StateStore, job: Json) -> Json | None:
    """The deployment of the job's current version, unless it already succeeded."""
    latest = latest_for_job(store, job["Namespace"], job["ID"])
    if latest is None or latest["Status"] == SUCCESSFUL:
        return None
    if latest["JobCreateIndex"] != job["CreateIndex"] or latest["JobVersion"] != job["Version"]:
        return None
    return latest


def destructive_budget(store: StateStore, job: Json | None) -> dict[str, int]:
    """How many allocations of each group may be replaced by this evaluation
    (`computeUnderProvisionedBy`): `max_parallel` less those of the deployment not yet found
    healthy; none while one is unhealthy or the deployment is failed or paused. Groups without
    a strategy are absent: they replace everything at once."""
    if job is None or job.get("Type") != "service":
        return {}
    current = current_for_job(store, job)
    budget: dict[str, int] = {}
    members = (
        [
            a
            for a in store.allocs_for_job(job["Namespace"], job["ID"])
            if a.get("DeploymentID") == current["ID"]
        ]
        if current is not None
        else []
    )
    for group in job["TaskGroups"]:
        strategy = update_strategy(group)
        if strategy is None:
            continue
        if current is not None and current["Status"] in (FAILED, PAUSED):
            budget[group["Name"]] = 0
            continue
        left = int(strategy["MaxParallel"])
        for alloc in members:
            if alloc["TaskGroup"] != group["Name"] or alloc["DesiredStatus"] != "run":
                continue
            if alloc["ClientStatus"] in ("complete", "failed", "lost"):
                continue
            healthy = (alloc.get("DeploymentStatus") or {}).get("Healthy")
            if healthy is False:
                left = 0
                break
            if healthy is None:
                left -= 1
        budget[group["Name"]] = max(left, 0)
    return budget


def plan_deployment(
    store: StateStore,
    job: Json | None,
    evaluation: Json,
    placed: list[Json],
    updated: list[Json],
    stopped: list[Json],
    pending_groups: set[str],
    now_ns: int,
) -> list[Json]:
    """The reconciler's deployment decisions for one evaluation: cancel the deployment of an
    older version or a stopped job, create one for a new version, tie this plan's placements
    and in-place updates to it, and mark it successful once nothing is left to place or replace
    and enough allocations are healthy. Returns the deployments to write (before the
    allocations); `placed` and `updated` are stamped in place. `pending_groups` are groups with
    work the plan could not do (queued placements, replacements held back by max_parallel)."""
    if evaluation.get("Type", "service") != "service":
        return []
    ns, job_id = evaluation["Namespace"], evaluation["JobID"]
    latest = latest_for_job(store, ns, job_id)
    writes: list[Json] = []
    if job is None or job.get("Stop"):
        if is_active(latest):
            assert latest is not None
            writes.append(with_status(latest, CANCELLED, DESC_STOPPED_JOB, now_ns))
        return writes
    current = latest
    if current is not None and (
        current["JobCreateIndex"] != job["CreateIndex"] or current["JobVersion"] != job["Version"]
    ):
        if is_active(current):
            writes.append(with_status(current, CANCELLED, DESC_NEWER_JOB, now_ns))
        current = None
    if current is not None and current["Status"] == SUCCESSFUL:
        current = None

    version_allocs = [
        a
        for a in store.allocs_for_job(ns, job_id)
        if (a.get("Job") or {}).get("Version") == job["Version"]
        and (a.get("Job") or {}).get("CreateIndex") == job["CreateIndex"]
        and not (a["DesiredStatus"] != "run" and a["ClientStatus"] in ("complete", "failed", "lost"))
    ]
    placed_by_group = _by_group(placed)
    # In-place updates: allocations moved to this version (not those only given a follow-up).
    inplace_by_group = _by_group(
        [
            a
            for a in updated
            if (a.get("Job") or {}).get("Version") == job["Version"]
            and ((store.allocs.get(a["ID"]) or {}).get("Job") or {}).get("Version") != job["Version"]
        ]
    )
    replaced = {a["TaskGroup"] for a in stopped if a.get("DesiredDescription") == _DESC_UPDATING}
    created: Json | None = None
    if current is None:
        for group in job["TaskGroups"]:
            strategy = update_strategy(group)
            if strategy is None or int(group.get("Count") or 0) == 0:
                continue
            name = group["Name"]
            updating = bool(inplace_by_group.get(name)) or name in replaced
            desired = len(placed_by_group.get(name, [])) + len(inplace_by_group.get(name, []))
            if desired or updating or name in pending_groups:
                desired = max(desired, int(group["Count"]))
            had_running = any(a["TaskGroup"] == name for a in version_allocs)
            if desired == 0 or (had_running and not updating):
                continue
            if created is None:
                created = new_deployment(job, int(evaluation.get("Priority") or 50), now_ns)
            created["TaskGroups"][name] = new_group_state(strategy, desired)
        if created is not None:
            writes.append(created)
            current = created
    if current is None or not is_active(current):
        return writes
    for alloc in placed:
        if alloc["TaskGroup"] in current["TaskGroups"]:
            alloc["DeploymentID"] = current["ID"]
            alloc["DeploymentStatus"] = None
    for alloc in updated:
        if (
            alloc["TaskGroup"] in current["TaskGroups"]
            and alloc.get("DeploymentID") != current["ID"]
            and (alloc.get("Job") or {}).get("Version") == job["Version"]
        ):
            alloc["DeploymentID"] = current["ID"]
            alloc["DeploymentStatus"] = None
    if current is not created and current["Status"] == RUNNING:
        done = all(
            not placed_by_group.get(name)
            and not inplace_by_group.get(name)
            and name not in replaced
            and name not in pending_groups
            and state["HealthyAllocs"] >= max(state["DesiredTotal"], state["DesiredCanaries"])
            for name, state in current["TaskGroups"].items()
        )
        if done:
            writes.append(with_status(current, SUCCESSFUL, DESC_SUCCESSFUL, now_ns))
    return writes


# The reconciler's description of a destructive update (kept in step with reconcile.py).
_DESC_UPDATING = "alloc is being updated due to job update"


def _by_group(allocs: list[Json]) -> dict[str, list[Json]]:
    out: dict[str, list[Json]] = {}
    for alloc in allocs:
        out.setdefault(alloc["TaskGroup"], []).append(alloc)
    return out


# ----- the client's health trackers and the deployment watcher ----------------------------------


class HealthWatcher:
    """Sets each service allocation's health, as the client's alloc health hook does, and
    watches active deployments, as the servers' deployment watcher does.

    An allocation in a deployment is judged by the group's update strategy, any other by its
    migrate strategy (which is what a drain waits for). Healthy: every task running for
    `min_healthy_time` and, with `health_check = "checks"`, every Consul check passing for as
    long; unhealthy: a task failed, or `healthy_deadline` passed first."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        submit_eval: Callable[[Json, str], Any],
        check_statuses: Callable[[str], tuple[int, list[str]] | None] | None = None,
        refresh_checks: Callable[[], Any] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        # (deployment, triggered-by) -> writes and submits an evaluation for the deployment's job.
        self.submit_eval = submit_eval
        # alloc ID -> (checks registered, their statuses), None without Consul.
        self.check_statuses = check_statuses
        self.refresh_checks = refresh_checks
        # alloc ID -> (deadline, min healthy time, use checks, lifecycle hooks of its tasks)
        self._tracking: dict[str, tuple[int, int, bool, dict[str, str]]] = {}
        self._passing_since: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nomad-deployments")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def track(self, alloc: Json) -> None:
        """Start judging an allocation the client starts (or that joins a deployment)."""
        job = alloc.get("Job") or {}
        if job.get("Type") != "service" or has_health(alloc):
            return
        group: Json = next(
            (g for g in job.get("TaskGroups") or [] if g.get("Name") == alloc["TaskGroup"]), {}
        )
        if alloc.get("DeploymentID"):
            strategy = group.get("Update") or {}
            if update_strategy(group) is None or strategy.get("HealthCheck") == "manual":
                return
        else:
            strategy = group.get("Migrate") or {
                "HealthCheck": "checks",
                "MinHealthyTime": 10 * 1_000_000_000,
                "HealthyDeadline": 300 * 1_000_000_000,
            }
        now = self.clock.now_ns()
        self._tracking[alloc["ID"]] = (
            now + int(strategy.get("HealthyDeadline") or 0),
            int(strategy.get("MinHealthyTime") or 0),
            strategy.get("HealthCheck") == "checks" and _has_checks(group),
            _lifecycle_hooks(alloc),
        )
        self._passing_since.pop(alloc["ID"], None)

    async def _run(self) -> None:
        # Nomad reads check statuses once a second of its clock; never faster than the poll.
        check_every = max(POLL_REAL_SECONDS, 1.0 / self.clock.speed)
        checks_read = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(POLL_REAL_SECONDS)
            try:
                if (
                    self._tracking
                    and self.refresh_checks is not None
                    and loop.time() - checks_read >= check_every
                ):
                    checks_read = loop.time()
                    await self.refresh_checks()
                self.tick()
            except Exception:
                log.exception("deployment watcher pass failed")

    def tick(self) -> None:
        now = self.clock.now_ns()
        verdicts: list[tuple[Json, bool]] = []
        for alloc_id, (deadline, min_healthy, use_checks, hooks) in list(self._tracking.items()):
            alloc = self.store.allocs.get(alloc_id)
            if alloc is None or alloc["DesiredStatus"] != "run" or has_health(alloc):
                self._forget(alloc_id)
                continue
            if not alloc.get("DeploymentID") and alloc["ClientStatus"] in ("complete", "failed", "lost"):
                # Outside a deployment nothing reads the verdict on a finished allocation (a
                # drain waits for running ones); not writing it spares a crash loop one write
                # per failure. Nomad's client does send it.
                self._forget(alloc_id)
                continue
            verdict = self._judge(alloc, now, deadline, min_healthy, use_checks, hooks)
            if verdict is not None:
                self._forget(alloc_id)
                verdicts.append((alloc, verdict))
        if verdicts:
            self._write_health(verdicts, now)
        self._watch_deployments(now)

    def _forget(self, alloc_id: str) -> None:
        self._tracking.pop(alloc_id, None)
        self._passing_since.pop(alloc_id, None)

    def _judge(
        self, alloc: Json, now: int, deadline: int, min_healthy: int, use_checks: bool, hooks: dict[str, str]
    ) -> bool | None:
        states = {
            name: state
            for name, state in (alloc.get("TaskStates") or {}).items()
            # A poststop task waits for the others; a prestart or poststart task that finished
            # well has done its job (allochealth tracker `watchTaskEvents`).
            if hooks.get(name) != "poststop"
            and not (hooks.get(name) in ("prestart", "poststart") and _finished_well(state))
        }
        if alloc["ClientStatus"] == "failed" or any(
            s.get("Failed") or parse_rfc3339_ns(s.get("FinishedAt")) for s in states.values()
        ):
            return False
        started = 0
        if states and all(s.get("State") == "running" for s in states.values()):
            started = max(parse_rfc3339_ns(s.get("StartedAt")) for s in states.values())
        healthy_at: int | None = started + min_healthy if started else None
        if healthy_at is not None and use_checks:
            checks = self.check_statuses(alloc["ID"]) if self.check_statuses is not None else None
            if checks is not None:
                # Without Consul the stand-in judges by task states alone (see docs/dev/devstack.md).
                wanted, statuses = checks
                if len(statuses) >= wanted > 0 and all(s == "passing" for s in statuses):
                    since = self._passing_since.setdefault(alloc["ID"], now)
                    healthy_at = max(healthy_at, since + min_healthy)
                else:
                    self._passing_since.pop(alloc["ID"], None)
                    healthy_at = None
        if healthy_at is not None and healthy_at <= now:
            return True
        if now >= deadline:
            return False
        return None

    def _write_health(self, verdicts: list[tuple[Json, bool]], now: int) -> None:
        evals: list[tuple[Json, str]] = []
        with self.store.batch():
            for alloc, healthy in verdicts:
                new = {
                    **alloc,
                    "DeploymentStatus": {
                        "Healthy": healthy,
                        "Timestamp": rfc3339(now),
                        "Canary": False,
                        "ModifyIndex": 0,
                    },
                }
                deployment = self.store.deployments.get(alloc.get("DeploymentID") or "")
                state = (deployment or {}).get("TaskGroups", {}).get(alloc["TaskGroup"])
                if is_active(deployment) and state is not None and not healthy and state["ProgressDeadline"]:
                    # A progress-based deployment lets an unhealthy allocation be replaced.
                    transition = dict(new.get("DesiredTransition") or {})
                    transition["Reschedule"] = True
                    new["DesiredTransition"] = transition
                self.store.upsert_alloc(new)
                if deployment is None or not is_active(deployment) or state is None:
                    continue
                deployment = self.store.deployments[deployment["ID"]]
                if not healthy and not state["ProgressDeadline"]:
                    self.store.upsert_deployment(with_status(deployment, FAILED, DESC_FAILED_ALLOCS, now))
                    evals.append((deployment, "deployment-watcher"))
                elif healthy:
                    evals.append((deployment, "deployment-watcher"))
        seen: set[str] = set()
        for deployment, trigger in evals:
            if deployment["ID"] not in seen:
                seen.add(deployment["ID"])
                self.submit_eval(deployment, trigger)

    def _watch_deployments(self, now: int) -> None:
        """Fail a deployment whose progress deadline passed without enough healthy allocations."""
        for deployment in self.store.active_deployments():
            if deployment["Status"] != RUNNING:
                continue
            for state in deployment["TaskGroups"].values():
                by = parse_rfc3339_ns(state["RequireProgressBy"])
                behind = state["HealthyAllocs"] < max(state["DesiredTotal"], state["DesiredCanaries"])
                if state["ProgressDeadline"] and by and now > by and behind:
                    self.store.upsert_deployment(with_status(deployment, FAILED, DESC_PROGRESS_DEADLINE, now))
                    self.submit_eval(self.store.deployments[deployment["ID"]], "deployment-watcher")
                    break


def _lifecycle_hooks(alloc: Json) -> dict[str, str]:
    """Task name -> lifecycle hook, for tasks that are not sidecars."""
    job = alloc.get("Job") or {}
    group: Json = next(
        (g for g in job.get("TaskGroups") or [] if g.get("Name") == alloc.get("TaskGroup")), {}
    )
    hooks: dict[str, str] = {}
    for task in group.get("Tasks") or []:
        lifecycle = task.get("Lifecycle") or {}
        if lifecycle.get("Hook") and not lifecycle.get("Sidecar"):
            hooks[str(task.get("Name"))] = str(lifecycle["Hook"])
    return hooks


def _finished_well(state: Json) -> bool:
    return state.get("State") == "dead" and not state.get("Failed")


def _has_checks(group: Json) -> bool:
    services = list(group.get("Services") or [])
    for task in group.get("Tasks") or []:
        services.extend(task.get("Services") or [])
    return any(s.get("Checks") for s in services)
