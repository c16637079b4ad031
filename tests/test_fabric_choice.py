"""Choosing the fabric for a multi-node replica, from hand-built fleets in Nomad's own JSON: only
fabrics with enough entirely free nodes, the one holding the weights first, then the best fit;
a fabric Nomad could not place on is tried last; when none fits, the reason names every fabric
with its largest free block."""

from __future__ import annotations

from typing import Any

from nomad_driver.placement import (
    FabricRoom,
    choose_fabric,
    fabric_constraint,
    fabric_rooms,
    failed_fabric,
    fallback_fabric,
    job_fabric,
    no_fabric_reason,
)
from nomad_driver.render import render_replica_job
from tests.test_multinode_render import SET
from tests.test_summary import alloc, node


def fleet(
    layout: dict[str, int], busy: dict[str, int] | None = None, cached: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`layout`: fabric -> nodes of one GPU each; `busy`: fabric -> how many of them hold a replica."""
    nodes: list[dict[str, Any]] = []
    allocs: list[dict[str, Any]] = []
    for fabric, count in layout.items():
        for i in range(count):
            node_id = f"{fabric}-{i}"
            meta = {"llmgw_fabric": fabric}
            if cached and cached.get(node_id):
                meta["llmgw_models_cached"] = cached[node_id]
            nodes.append(node(node_id, [(f"{node_id}-gpu", True)], meta=meta))
            if i < (busy or {}).get(fabric, 0):
                allocs.append(alloc(f"a-{node_id}", node_id, [f"{node_id}-gpu"], model="other"))
    return nodes, allocs


def test_only_a_fabric_with_enough_entirely_free_nodes_is_chosen() -> None:
    nodes, allocs = fleet({"ib-a": 3, "ib-b": 2}, busy={"ib-a": 2})
    rooms = fabric_rooms(nodes, allocs, "m")
    assert {r.fabric: r.largest_free_block for r in rooms} == {"ib-a": 1, "ib-b": 2}
    assert choose_fabric(rooms, 2) == "ib-b"


def test_the_fabric_holding_the_weights_wins_then_the_best_fit() -> None:
    nodes, allocs = fleet({"ib-a": 4, "ib-b": 2, "ib-c": 3}, cached={"ib-c-0": "gemma,other"})
    rooms = fabric_rooms(nodes, allocs, "gemma")
    assert choose_fabric(rooms, 2) == "ib-c"  # the weights are there
    assert choose_fabric(fabric_rooms(nodes, allocs, "llama"), 2) == "ib-b"  # the tightest fit
    assert choose_fabric(rooms, 4) == "ib-a"  # the only one big enough


def test_a_fabric_nomad_could_not_place_on_is_tried_last() -> None:
    rooms = [FabricRoom("ib-a", 2), FabricRoom("ib-b", 3)]
    assert choose_fabric(rooms, 2) == "ib-a"
    assert choose_fabric(rooms, 2, tried=["ib-a"]) == "ib-b"
    # Every fabric tried: start over with the best one rather than giving up.
    assert choose_fabric(rooms, 2, tried=["ib-a", "ib-b"]) == "ib-a"


def test_no_fabric_big_enough_names_each_fabric_and_its_largest_free_block() -> None:
    nodes, allocs = fleet({"ib-a": 3, "ib-b": 3}, busy={"ib-a": 1, "ib-b": 1})
    rooms = fabric_rooms(nodes, allocs, "m")
    assert choose_fabric(rooms, 3) is None
    assert (
        no_fabric_reason(rooms, 3)
        == "needs 3 entirely free nodes in one fabric; largest free blocks: ib-a 2, ib-b 2"
    )
    # Freeing a node in one fabric lets it place there.
    nodes, allocs = fleet({"ib-a": 3, "ib-b": 3}, busy={"ib-a": 1})
    assert choose_fabric(fabric_rooms(nodes, allocs, "m"), 3) == "ib-b"
    assert no_fabric_reason([], 2).endswith("no node reports a fabric (llmgw_fabric)")


def test_a_node_that_is_down_or_partly_used_is_no_room() -> None:
    nodes, allocs = fleet({"ib-a": 2})
    nodes[1]["Status"] = "down"
    assert fabric_rooms(nodes, allocs, "m") == [FabricRoom("ib-a", 1, nodes=2)]


def test_the_chosen_fabric_pins_every_shard_of_the_replica() -> None:
    job = render_replica_job(SET.models["gemma-split"], 0, fabric="ib-b")
    assert fabric_constraint("ib-b") in job["Constraints"]
    assert {"Operand": "distinct_hosts", "RTarget": "true"} in job["Constraints"]


def test_a_replica_no_fabric_has_room_for_is_pinned_where_it_could_fit_once_free() -> None:
    rooms = [FabricRoom("ib-a", 1, nodes=2), FabricRoom("ib-b", 0, nodes=4), FabricRoom("eth", 1, nodes=1)]
    assert fallback_fabric(rooms, 3) == "ib-b"
    # None big enough even when empty: still pinned, to the biggest.
    assert fallback_fabric(rooms, 5) == "ib-b"
    assert fallback_fabric([], 2) is None


def test_the_fabric_a_placement_failed_on_is_read_from_nomads_constraint_metrics() -> None:
    metric = {"ConstraintFiltered": {"${meta.llmgw_fabric} = ib-b": 3, "distinct_hosts": 1}}
    assert failed_fabric({"engine": metric}) == "ib-b"
    assert failed_fabric({"engine": {"ConstraintFiltered": {"distinct_hosts": 1}}}) == ""
    assert failed_fabric(None) == ""
    job = render_replica_job(SET.models["gemma-split"], 0, fabric="ib-b")
    assert job_fabric(job) == "ib-b"
    assert job_fabric(render_replica_job(SET.models["gemma-split"], 0)) == ""
