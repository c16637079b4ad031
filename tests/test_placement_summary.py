"""The placement summary an operator reads instead of "no placement" 250 times."""

from __future__ import annotations

from typing import Any

from nomad_driver.placement import PlacementWarnings, latest_placement_failure, summarize_placement

JOB: dict[str, Any] = {
    "ID": "llmgw-big",
    "TaskGroups": [
        {
            "Name": "engine",
            "Tasks": [
                {
                    "Name": "engine",
                    "Resources": {
                        "CPU": 2000,
                        "MemoryMB": 16384,
                        "Devices": [
                            {
                                "Name": "nvidia/gpu",
                                "Count": 2,
                                "Constraints": [
                                    {"LTarget": "${device.attr.memory}", "Operand": ">=", "RTarget": "80 GiB"}
                                ],
                            }
                        ],
                    },
                }
            ],
        }
    ],
}

METRIC: dict[str, Any] = {
    "NodesEvaluated": 5,
    "NodesFiltered": 3,
    "NodesInPool": 5,
    "NodePool": "default",
    "NodesAvailable": {"dc1": 5},
    "ClassFiltered": {},
    "ConstraintFiltered": {"missing devices": 3},
    "NodesExhausted": 2,
    "DimensionExhausted": {"devices: no devices match request": 2},
    "CoalescedFailures": 0,
}


def test_summary_names_the_request_and_each_reason_counted() -> None:
    assert summarize_placement({"engine": METRIC}, JOB) == (
        "no node has 2 x nvidia/gpu with memory >= 80 GiB: 3 nodes filtered (missing devices), "
        "2 exhausted (devices: no devices match request)"
    )


def test_summary_without_the_job_still_names_the_group_and_reasons() -> None:
    text = summarize_placement({"engine": METRIC})
    assert text.startswith("no node fits task group 'engine': 3 nodes filtered")
    assert "devices: no devices match request" in text


def test_several_reasons_are_counted_most_common_first() -> None:
    metric = dict(METRIC, NodesFiltered=4, ConstraintFiltered={"missing devices": 3, "missing drivers": 1})
    assert "4 nodes filtered (3 missing devices, 1 missing drivers)" in summarize_placement(
        {"engine": metric}
    )


def test_empty_cluster_says_no_node_was_eligible() -> None:
    metric = {"NodesEvaluated": 0, "NodesFiltered": 0, "NodesExhausted": 0, "NodesAvailable": {"dc1": 0}}
    assert summarize_placement({"engine": metric}, JOB) == (
        "no node has 2 x nvidia/gpu with memory >= 80 GiB: no nodes are available in datacenter dc1"
    )


def test_garbage_metrics_do_not_raise() -> None:
    assert summarize_placement(None) == "placement failed (Nomad gave no placement metrics)"
    assert summarize_placement({"engine": "what"}, {"TaskGroups": "x"}).startswith("no node fits task group")
    assert "1 node filtered" in summarize_placement({"g": {"NodesFiltered": "1", "NodesEvaluated": 1}})


def _eval(eid: str, idx: int, status: str, failed: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "ID": eid,
        "CreateIndex": idx,
        "ModifyIndex": idx,
        "Status": status,
        "FailedTGAllocs": failed,
        **kw,
    }


def test_blocked_evaluation_makes_the_model_unplaceable() -> None:
    evals = [
        _eval("a", 10, "complete", {"engine": METRIC}, BlockedEval="b"),
        _eval("b", 11, "blocked", {"engine": METRIC}, PreviousEval="a"),
    ]
    failure = latest_placement_failure(evals, JOB)
    assert failure is not None
    assert failure.eval_id == "b"
    assert failure.reason.startswith("no node has 2 x nvidia/gpu")


def test_blocked_eval_without_metrics_borrows_its_parents() -> None:
    evals = [
        _eval("a", 10, "complete", {"engine": METRIC}, BlockedEval="b"),
        _eval("b", 11, "blocked", None, PreviousEval="a"),
    ]
    failure = latest_placement_failure(evals)
    assert failure is not None and "3 nodes filtered" in failure.reason


def test_placing_after_a_node_joins_clears_unplaceable() -> None:
    evals = [
        _eval("a", 10, "complete", {"engine": METRIC}, BlockedEval="b"),
        _eval("b", 11, "complete", None, PreviousEval="a"),
    ]
    assert latest_placement_failure(evals) is None


def test_pending_and_canceled_evals_do_not_decide() -> None:
    evals = [
        _eval("b", 11, "blocked", {"engine": METRIC}),
        _eval("c", 12, "pending"),
        _eval("d", 13, "canceled"),
    ]
    failure = latest_placement_failure(evals)
    assert failure is not None and failure.eval_id == "b"
    assert latest_placement_failure([]) is None


def test_the_warning_is_logged_when_the_reason_changes_or_every_ten_minutes() -> None:
    now = [1000.0]
    warnings = PlacementWarnings(lambda: now[0])
    assert warnings.should_log("big", "no node has 2 x nvidia/gpu")
    for _ in range(100):
        now[0] += 5
        assert not warnings.should_log("big", "no node has 2 x nvidia/gpu")
    assert warnings.should_log("big", "no node has 4 x nvidia/gpu")  # a new reason is news
    now[0] += 601
    assert warnings.should_log("big", "no node has 4 x nvidia/gpu")
    warnings.clear("big")
    assert warnings.should_log("big", "no node has 4 x nvidia/gpu")
