"""reconcile() for a multi-node model, on hand-built snapshots in Nomad's JSON: its job is never
registered unpinned, it moves fabric when Nomad could not place it on the pinned one, it is
unplaceable naming every fabric when none has room, its shards follow its leader, and a shard
that fails fails its replica's start, once, and restarts the replica whole."""

from __future__ import annotations

import dataclasses
from typing import Any

from nomad_driver.placement import fabric_constraint, fabric_rooms
from nomad_driver.render import SHARD_GROUP, render_job
from nomad_driver.state import ModelState
from nomad_driver.watcher.decisions import ModelView, Park, RegisterJob, Scale, WriteState
from nomad_driver.watcher.reconcile import reconcile
from tests.test_fabric_choice import fleet
from tests.test_multinode_replica_rules import WIDE
from tests.test_parking import ev

NOW = 1e6


def pinned_job(fabric: str, leader: int = 1, shards: int | None = None) -> dict[str, Any]:
    job = render_job(WIDE)
    job["Constraints"].append(fabric_constraint(fabric))
    job["TaskGroups"][0]["Count"] = leader
    job["TaskGroups"][1]["Count"] = leader * 2 if shards is None else shards
    return job


def rooms(layout: dict[str, int], busy: dict[str, int] | None = None) -> tuple[Any, ...]:
    nodes, allocs = fleet(layout, busy)
    return tuple(fabric_rooms(nodes, allocs, WIDE.name))


def view(**kw: Any) -> ModelView:
    kw.setdefault("now", NOW)
    return ModelView(model=WIDE, **kw)


def failed_eval(fabric: str, index: int = 10) -> dict[str, Any]:
    metric = {
        "NodesEvaluated": 6,
        "NodesFiltered": 3,
        "ConstraintFiltered": {f"${{meta.llmgw_fabric}} = {fabric}": 3},
        "NodesExhausted": 3,
        "DimensionExhausted": {"devices: no devices match request": 3},
    }
    return {
        "ID": f"eval-{index}",
        "JobID": WIDE.job_id,
        "Status": "complete",
        "CreateIndex": index,
        "ModifyIndex": index,
        "FailedTGAllocs": {"engine": metric, SHARD_GROUP: metric},
    }


def leader(aid: str, *events: dict[str, Any], status: str = "running") -> dict[str, Any]:
    return {
        "ID": aid,
        "JobID": WIDE.job_id,
        "TaskGroup": "engine",
        "NodeName": "ib-a-0",
        "ClientStatus": status,
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": list(events)}},
    }


def shard(aid: str, node: str, *events: dict[str, Any], status: str = "failed") -> dict[str, Any]:
    return {**leader(aid, *events, status=status), "TaskGroup": SHARD_GROUP, "NodeName": node}


def crash(t: int) -> list[dict[str, Any]]:
    return [ev("Started", t), ev("Terminated", t + 1, DisplayMessage="Exit Code: 1")]


def registered(d: Any) -> list[RegisterJob]:
    return [a for a in d.actions if isinstance(a, RegisterJob)]


def test_it_is_not_registered_before_the_nodes_are_read() -> None:
    d = reconcile(view(job=None, fabric_rooms=None))
    assert registered(d) == []
    # Nor re-registered while they are unknown: an unpinned job stays until the room is known.
    unpinned = render_job(WIDE)
    assert registered(reconcile(view(job=unpinned, fabric_rooms=None))) == []


def test_it_is_registered_pinned_to_the_fabric_with_room_and_an_unpinned_job_is_pinned() -> None:
    room = rooms({"ib-a": 3, "ib-b": 4}, busy={"ib-b": 2})
    assert registered(reconcile(view(job=None, fabric_rooms=room))) == [RegisterJob("wide", 1, "ib-a")]
    # Registered without a fabric (by `llmgw apply`): pinned at once, not left to span two.
    (again,) = registered(reconcile(view(job=render_job(WIDE), fabric_rooms=room)))
    assert again.fabric == "ib-a"
    # Pinned and current: nothing to do.
    d = reconcile(view(job=pinned_job("ib-a"), fabric_rooms=room))
    assert not [a for a in d.actions if isinstance(a, (RegisterJob, Scale))]


def test_no_fabric_with_room_is_unplaceable_naming_every_fabric_over_nomads_reason() -> None:
    room = rooms({"ib-a": 3, "ib-b": 3}, busy={"ib-a": 1, "ib-b": 1})
    reason = "needs 3 entirely free nodes in one fabric; largest free blocks: ib-a 2, ib-b 2"
    # Never registered before: pinned to a fabric that can hold it once free, at count 0.
    d = reconcile(view(job=None, fabric_rooms=room))
    assert registered(d) == [RegisterJob("wide", 0, "ib-a")]
    assert d.state.unplaceable and d.state.placement_reason == reason
    # Registered at 0 and failed on its fabric: still the fabrics' reason, not Nomad's, and
    # neither moved nor scaled up while nowhere has room.
    d = reconcile(view(job=pinned_job("ib-a", 0), evals=(failed_eval("ib-a"),), fabric_rooms=room))
    assert d.state.placement_reason == reason and d.state.placement_eval == ""
    assert not [a for a in d.actions if isinstance(a, (RegisterJob, Scale))]
    assert d.health == "critical" and reason in d.health_output
    # A node freed in ib-b: it moves there and places.
    freed = rooms({"ib-a": 3, "ib-b": 3}, busy={"ib-a": 1})
    d = reconcile(view(job=pinned_job("ib-a", 0), state=d.state, fabric_rooms=freed))
    assert registered(d) == [RegisterJob("wide", 1, "ib-b")]
    assert not d.state.unplaceable


def test_a_failed_placement_on_the_pinned_fabric_moves_it_to_the_next_once() -> None:
    room = rooms({"ib-a": 3, "ib-b": 3})
    d = reconcile(view(job=pinned_job("ib-a"), evals=(failed_eval("ib-a"),), fabric_rooms=room))
    assert registered(d) == [RegisterJob("wide", 1, "ib-b")]
    assert d.state.fabrics_tried == ["ib-a"]
    # Re-registered on ib-b; its evaluation is not decided yet, so the newest failure is still
    # ib-a's: no second move.
    moved = view(job=pinned_job("ib-b"), evals=(failed_eval("ib-a"),), state=d.state, fabric_rooms=room)
    d = reconcile(moved)
    assert registered(d) == []
    # It fails on ib-b too: every fabric tried, it goes back to the best one and stays there.
    d = reconcile(
        dataclasses.replace(moved, evals=(failed_eval("ib-a"), failed_eval("ib-b", 11)), state=d.state)
    )
    assert registered(d) == [RegisterJob("wide", 1, "ib-a")]
    assert d.state.fabrics_tried == ["ib-a", "ib-b"]
    d = reconcile(
        view(job=pinned_job("ib-a"), evals=(failed_eval("ib-a", 12),), state=d.state, fabric_rooms=room)
    )
    assert registered(d) == []
    # A healthy replica starts the fabrics afresh.
    d = reconcile(view(job=pinned_job("ib-a"), ready=1, state=d.state, fabric_rooms=room))
    assert d.state.fabrics_tried == []


def test_its_shards_follow_its_leader() -> None:
    # A router activated the model by scaling the leader alone: the watcher scales the shards.
    room = rooms({"ib-a": 3})
    d = reconcile(view(job=pinned_job("ib-a", 1, shards=0), fabric_rooms=room, activity=NOW))
    (scale,) = [a for a in d.actions if isinstance(a, Scale)]
    assert scale.count == 1 and "its shards with it: 2 of 2" in scale.message
    # Parked: leader and shards at 0, whatever a router left.
    parked = ModelState(
        parked=True, parked_def_hash=WIDE.def_hash, consecutive_failures=5, count_def_hash=WIDE.def_hash
    )
    d = reconcile(view(job=pinned_job("ib-a", 0, shards=2), fabric_rooms=room, state=parked))
    (scale,) = [a for a in d.actions if isinstance(a, Scale)]
    assert scale.count == 0


def test_a_shard_failing_while_its_leader_waits_fails_that_replica_start_once_and_restarts_it() -> None:
    room = rooms({"ib-a": 3})
    # The leader waits for its shards (one open start); a shard fails twice during it.
    waiting = leader("lead", ev("Started", 10))
    broken = shard(
        "5hard-1", "ib-a-1", *crash(12), ev("Restarting", 14), *crash(15), ev("Not Restarting", 17)
    )
    v = view(job=pinned_job("ib-a"), allocs=(waiting, broken), fabric_rooms=room)
    d = reconcile(v)
    assert d.state.consecutive_failures == 1
    assert d.state.last_error == "shard 5hard-1 on node ib-a-1: Exit Code: 1"
    # Nothing would ever restart it (the shard never passes its check, so the leader's
    # template never changes): the watcher stops the replica, and starts it again next pass.
    (scale,) = [a for a in d.actions if isinstance(a, Scale)]
    assert scale.count == 0 and "shard 5hard-1 on node ib-a-1 failed" in scale.message
    assert d.state.replica_restarted == "lead@10"
    # Asked once per start, even if the next pass still sees the leader running.
    again = reconcile(dataclasses.replace(v, state=d.state, state_index=3))
    assert not [a for a in again.actions if isinstance(a, Scale)]
    assert again.state.consecutive_failures == 1


def test_a_shard_that_dies_under_a_healthy_replica_is_no_failed_start() -> None:
    room = rooms({"ib-a": 3})
    serving = leader("lead", ev("Started", 10))
    killed = shard("5hard-1", "ib-a-1", ev("Started", 5), ev("Terminated", 30), status="running")
    first = reconcile(
        view(
            job=pinned_job("ib-a"),
            allocs=(serving,),
            ready=1,
            healthy_starts=frozenset({(10, "lead")}),
            fabric_rooms=room,
        )
    )
    # The shard dies after the start was healthy (its baseline is stored): nothing counts,
    # nothing is restarted by llmgw; Nomad restarts the shard and the template the leader.
    d = reconcile(
        view(job=pinned_job("ib-a"), allocs=(serving, killed), state=first.state, fabric_rooms=room)
    )
    assert d.state.consecutive_failures == 0
    assert not [a for a in d.actions if isinstance(a, Scale)]


def test_five_replica_starts_park_it_with_the_shard_named_whichever_shard_failed() -> None:
    room = rooms({"ib-a": 3})
    allocs = []
    for i in range(5):
        t = 100 * i + 10
        allocs.append(
            leader(
                f"lead{i}",
                ev("Started", t),
                ev("Killing", t + 50),
                ev("Terminated", t + 51),
                status="complete",
            )
        )
        # Two shards fail during the same start: one replica start, counted once.
        allocs.append(shard(f"5hard{i}a", "ib-a-1", *crash(t + 2)))
        allocs.append(shard(f"5hard{i}b", "ib-a-2", *crash(t + 3)))
    d = reconcile(view(job=pinned_job("ib-a"), allocs=tuple(allocs), fabric_rooms=room))
    (park,) = [a for a in d.actions if isinstance(a, Park)]
    assert park.failures == 5
    # The stderr to read is the first failed shard's of the last start; the cause names it.
    assert (park.alloc_id, park.task, park.cause) == ("5hard4a", "engine", "shard 5hard4a on node ib-a-1")
    assert not [a for a in d.actions if isinstance(a, (Scale, WriteState))]


RE_RENDERED = "template with change_mode restart re-rendered"


def test_a_shard_that_dies_before_its_leader_restarts_into_it_fails_one_replica_start_named_the_shard() -> (
    None
):
    # The shard registers and dies at once; the leader's template renders the registration a
    # moment later (a loaded machine), so the leader restarts into a shard set that is already
    # gone and llama-server aborts with a backtrace. One replica start failed, the shard's.
    room = rooms({"ib-a": 3})
    lead = leader(
        "lead",
        ev("Started", 10),  # waiting for its shards
        ev("Restart Signaled", 13, RestartReason=RE_RENDERED),
        ev("Terminated", 13, DisplayMessage="Exit Code: 0"),
        ev("Started", 14),  # llama-server with the dead shard's address
        ev("Terminated", 15, DisplayMessage="Exit Code: 134"),
        ev("Restarting", 15),
    )
    broken = shard("5hard-1", "ib-a-1", *crash(11), ev("Restarting", 12))
    d = reconcile(view(job=pinned_job("ib-a"), allocs=(lead, broken), fabric_rooms=room))
    assert d.state.consecutive_failures == 1
    assert d.state.last_error == "shard 5hard-1 on node ib-a-1: Exit Code: 1"


def test_a_watcher_that_saw_the_shard_fail_first_counts_the_leaders_abort_that_follows_as_the_same_start() -> (
    None
):
    # The same, read twice: once right after the shard died (the leader still waiting, so the
    # watcher restarts the replica), once after the leader's abort. Still one failed start.
    room = rooms({"ib-a": 3})
    broken = shard("5hard-1", "ib-a-1", *crash(11), ev("Restarting", 12))
    waiting = leader("lead", ev("Started", 10))
    first = reconcile(view(job=pinned_job("ib-a"), allocs=(waiting, broken), fabric_rooms=room))
    assert first.state.consecutive_failures == 1
    aborted = leader(
        "lead",
        ev("Started", 10),
        ev("Restart Signaled", 13, RestartReason=RE_RENDERED),
        ev("Terminated", 13, DisplayMessage="Exit Code: 0"),
        ev("Started", 14),
        ev("Terminated", 15, DisplayMessage="Exit Code: 134"),
        ev("Restarting", 15),
    )
    d = reconcile(
        view(
            job=pinned_job("ib-a"),
            allocs=(aborted, broken),
            fabric_rooms=room,
            state=first.state,
            state_index=3,
        )
    )
    assert d.state.consecutive_failures == 1
    assert d.state.last_error.startswith("shard 5hard-1 on node ib-a-1")


def test_a_replica_restarted_whole_whose_new_shard_dies_before_its_leader_starts_names_the_shard() -> None:
    # The watcher stopped the stuck replica and Nomad placed a new one. Its shard registers and
    # dies before the new leader has started; the leader renders the dead shard's address and
    # llama-server aborts with a backtrace. That start failed because of the shard, and says so,
    # as does the one after it that the same crash-looping shard fails.
    room = rooms({"ib-a": 3})
    old = leader(
        "lead0", ev("Started", 10), ev("Killing", 60), ev("Terminated", 61, DisplayMessage="Exit Code: 0")
    )
    old = {**old, "DesiredStatus": "stop", "ClientStatus": "complete"}
    old_shard = {**shard("5hard-0", "ib-a-1", *crash(12), ev("Restarting", 14)), "DesiredStatus": "stop"}
    new = leader(
        "lead1",
        ev("Started", 100),
        ev("Terminated", 101, DisplayMessage="Exit Code: 134"),
        ev("Restarting", 101),
        ev("Started", 103),  # waiting for its shard again
    )
    new_shard = shard("5hard-1", "ib-a-2", *crash(95), ev("Restarting", 97), *crash(105), status="running")
    d = reconcile(view(job=pinned_job("ib-a"), allocs=(old, old_shard, new, new_shard), fabric_rooms=room))
    assert d.state.consecutive_failures == 3
    assert d.state.last_error == "shard 5hard-1 on node ib-a-2: Exit Code: 1"
    # The abort itself, read on its own (the shard's second death not yet seen), names it too.
    aborted = leader(
        "lead1",
        ev("Started", 100),
        ev("Terminated", 101, DisplayMessage="Exit Code: 134"),
        ev("Restarting", 101),
    )
    once = shard("5hard-1", "ib-a-2", *crash(95), ev("Restarting", 97), status="running")
    d = reconcile(view(job=pinned_job("ib-a"), allocs=(old, old_shard, aborted, once), fabric_rooms=room))
    assert d.state.consecutive_failures == 2
    assert d.state.last_error == "shard 5hard-1 on node ib-a-2: Exit Code: 1"
