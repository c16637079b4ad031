"""When Nomad gives up on a slot before llmgw's count reaches its threshold, the model is named
as such and llmgw asks Nomad again; it is never left down, neither parked nor serving."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from nomad_driver.render import RESCHEDULE_POLICY
from nomad_driver.watcher.counting import retried
from nomad_driver.watcher.decisions import ForceReschedule
from nomad_driver.watcher.given_up import reschedule_eligible, spent_slots
from nomad_driver.watcher.reconcile import reconcile
from tests.test_reconcile import KEV, NOW, crashed, job, view

HOUR_NS = 3_600_000_000_000


def spent(aid: str, t: int, reschedules: int) -> dict[str, Any]:
    """A failed allocation whose reschedules within the last day number `reschedules`."""
    alloc = crashed(aid, t)
    events = [
        {"RescheduleTime": t - (i + 1) * HOUR_NS, "PrevAllocID": f"p{i}", "Delay": 60}
        for i in range(reschedules)
    ]
    return {**alloc, "TaskGroup": "engine", "RescheduleTracker": {"Events": events}}


def test_nomads_own_eligibility_rule_counts_reschedules_within_the_interval() -> None:
    t = int(NOW * 1e9)
    assert reschedule_eligible(spent("a", t, 1), RESCHEDULE_POLICY)
    assert not reschedule_eligible(spent("a", t, 2), RESCHEDULE_POLICY)
    old = spent("a", t, 2)
    old["RescheduleTracker"]["Events"][1]["RescheduleTime"] = t - 25 * HOUR_NS  # out of the interval
    assert reschedule_eligible(old, RESCHEDULE_POLICY)


def test_a_slot_nomad_gave_up_on_is_named_and_asked_again() -> None:
    t = int(NOW * 1e9) - 10_000_000_000
    # Two failed starts counted, and Nomad will not reschedule the allocation again: the
    # count is 2, the job's count is what llmgw wants, and without this nothing would move.
    allocs = (spent("a1", t - 5000, 1) | {"NextAllocation": "a2"}, spent("a2", t, 2))
    decision = reconcile(view(job=job(KEV, 1), allocs=allocs), 5)
    assert not decision.state.parked and decision.state.consecutive_failures == 2
    assert ForceReschedule("kev", KEV.job_id, ("a2",)) in decision.actions
    assert decision.state.nomad_gave_up.startswith("Nomad will not replace failed allocation(s) a2")
    assert decision.health == "critical" and "force-reschedule" in decision.health_output
    # Asked: the allocation carries Nomad's transition, and it is not asked twice.
    asked = (allocs[0], {**allocs[1], "DesiredTransition": {"ForceReschedule": True}})
    again = reconcile(view(job=job(KEV, 1), allocs=asked), 5)
    assert not any(isinstance(a, ForceReschedule) for a in again.actions)
    assert again.state.nomad_gave_up == ""


def test_beside_a_serving_replica_a_spent_slot_is_shown_and_asked_again_only_after_a_retry() -> None:
    """A partial failure (docs/watcher.md): Nomad's budgets bound a bad node's slot, and llmgw
    does not force attempts beyond them while another replica serves, unless asked to."""
    t = int(NOW * 1e9) - 10_000_000_000
    serving = {
        "ID": "ok",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "TaskGroup": "engine",
        "NodeName": "gpu-1",
        "TaskStates": {"engine": {"Events": [{"Type": "Started", "Time": t - 90_000}]}},
    }
    bad = spent("a2", t, 2) | {"NodeName": "gpu-7"}
    v = view(job=job(KEV, 2), allocs=(serving, bad), healthy_starts=frozenset({(t - 90_000, "ok")}), ready=1)
    decision = reconcile(v, 5)
    assert not any(isinstance(a, ForceReschedule) for a in decision.actions)
    assert decision.state.nomad_gave_up == "" and not decision.state.parked
    assert "the replica a2 on node gpu-7 failed 1 start(s) in a row" in decision.state.degraded
    assert "llmgw ctl retry kev" in decision.state.degraded
    assert decision.health == "warning" and decision.health_output.startswith("degraded: 1 of ")
    # The operator retries: the slot is asked again.
    retried_view = view(
        job=job(KEV, 2),
        allocs=(serving, bad),
        healthy_starts=frozenset({(t - 90_000, "ok")}),
        ready=1,
        state=retried(v),
    )
    assert ForceReschedule("kev", KEV.job_id, ("a2",)) in reconcile(retried_view, 5).actions


def test_a_failed_allocation_nomad_will_still_reschedule_is_left_to_nomad() -> None:
    t = int(NOW * 1e9)
    assert spent_slots(job(KEV, 1), [spent("a", t, 1)]) == ()
    assert spent_slots(job(KEV, 1), [spent("a", t, 2) | {"FollowupEvalID": "e"}]) == ()


def test_the_standin_replaces_a_spent_failed_allocation_when_forced(
    start_standin: Callable[..., Any],
) -> None:
    """`nomad job eval -force-reschedule` as Nomad's job endpoint does it: a failed allocation
    whose policy allows no reschedule is replaced now."""
    standin = start_standin(consul=False, clock_speed=20.0)
    batch = {
        "ID": "spent",
        "Name": "spent",
        "Type": "service",
        "Datacenters": ["*"],
        "TaskGroups": [
            {
                "Name": "g",
                "Count": 1,
                "RestartPolicy": {"Attempts": 0, "Mode": "fail", "Interval": 60_000_000_000, "Delay": 1},
                "ReschedulePolicy": {"Attempts": 1, "Interval": 24 * HOUR_NS, "Delay": 1, "Unlimited": False},
                "Tasks": [
                    {"Name": "t", "Driver": "mock_driver", "Config": {"run_for": "0s", "exit_code": 1}}
                ],
            }
        ],
    }
    url = standin.url
    assert httpx.put(f"{url}/v1/jobs", json={"Job": batch}, timeout=10).status_code == 200

    def allocs() -> list[dict[str, Any]]:
        return list(httpx.get(f"{url}/v1/job/spent/allocations", timeout=10).json())

    def settled(n: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = allocs()
            if len(found) == n and all(a["ClientStatus"] == "failed" for a in found):
                time.sleep(0.5)
                if len(allocs()) == n:
                    return found
            time.sleep(0.1)
        raise AssertionError(
            f"not {n} failed allocations: {[(a['ID'][:8], a['ClientStatus']) for a in allocs()]}"
        )

    # One reschedule allowed: two allocations fail, and Nomad gives up.
    settled(2)
    reply = httpx.post(
        f"{url}/v1/job/spent/evaluate",
        json={"JobID": "spent", "EvalOptions": {"ForceReschedule": True}},
        timeout=10,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["EvalID"]
    third = settled(3)
    forced = [a for a in third if (a.get("DesiredTransition") or {}).get("ForceReschedule")]
    assert len(forced) == 1 and forced[0]["NextAllocation"]


def test_a_group_whose_reschedule_policy_is_disabled_is_named_not_asked_in_vain() -> None:
    """Nomad's `Job.Evaluate` forces a reschedule only where the group's policy is enabled
    (nomad/job_endpoint.go); with attempts 0 the request does nothing, so llmgw does not make
    it, and says why the model is down."""
    t = int(NOW * 1e9) - 10_000_000_000
    disabled = job(KEV, 1)
    disabled["TaskGroups"][0]["ReschedulePolicy"] = {"Attempts": 0, "Interval": 0, "Unlimited": False}
    decision = reconcile(view(job=disabled, allocs=(spent("a2", t, 0),)), 5)
    assert not any(isinstance(a, ForceReschedule) for a in decision.actions)
    assert "reschedule policy is disabled (attempts 0)" in decision.state.nomad_gave_up
    assert decision.health == "critical"
