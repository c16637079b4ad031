"""The store's running sums of what live allocations hold (`devstack/nomad/usage.py`) must be
what a pass over the live allocations gives, whatever order allocations came and went in, and a
placement against them must choose what a placement against the list chooses."""

from __future__ import annotations

import random
from typing import Any

from devstack.nomad.nodes import load_nodes
from devstack.nomad.placement import place_group
from devstack.nomad.state import StateStore
from devstack.nomad.usage import LiveUsage, UsageView
from tests.standin.test_feasible import make_job
from tests.standin.test_placement import LARGE, as_alloc


def same_sums(a: LiveUsage, b: LiveUsage) -> None:
    nonzero = {k: v for k, v in a.nodes.items() if v.cpu or v.memory or v.disk or v.jobs}
    assert nonzero == {k: v for k, v in b.nodes.items() if v.cpu or v.memory or v.disk or v.jobs}
    assert a.ports == b.ports
    assert {k: set(v) for k, v in a.by_job.items()} == {k: set(v) for k, v in b.by_job.items()}


def test_store_sums_match_a_full_pass_after_starts_stops_and_deletes() -> None:
    rng = random.Random(7)
    nodes = load_nodes(LARGE)
    store = StateStore()
    ids: list[str] = []
    for i in range(120):
        job, group = make_job(f"j{i % 30}", gpus=i % 2, cpu=500, memory=1024, count=1)
        (placement,) = place_group(job, group, nodes, UsageView(store.live_usage), 1).placed
        alloc = {**as_alloc(job, placement, "pending"), "ID": f"a{i}"}
        store.upsert_alloc(alloc)
        ids.append(alloc["ID"])
        if i % 3 == 0:  # a random earlier allocation moves on
            victim = dict(store.allocs[rng.choice(list(store.allocs))])
            victim["ClientStatus"] = rng.choice(["running", "complete", "failed"])
            victim["DesiredStatus"] = rng.choice(["run", "run", "stop"])
            store.upsert_alloc(victim)
        if i % 10 == 0:
            store.delete_evals_allocs([], [rng.choice(ids)])  # perhaps one already deleted
    assert store.live_allocs
    same_sums(store.live_usage, LiveUsage.of(store.live_allocs.values()))


def test_a_view_places_where_the_list_would() -> None:
    nodes = load_nodes(LARGE)
    store = StateStore()
    for i in range(60):
        job, group = make_job(f"j{i}", gpus=1, cpu=4000, memory=16384, count=1)
        (placement,) = place_group(job, group, nodes, UsageView(store.live_usage), 1).placed
        store.upsert_alloc({**as_alloc(job, placement), "ID": f"a{i}"})
    live: list[dict[str, Any]] = list(store.live_allocs.values())
    stopping = {"a3", "a17", "a40"}
    job, group = make_job("extra", gpus=1, cpu=4000, memory=16384, count=1)
    (p,) = place_group(job, group, nodes, [a for a in live if a["ID"] not in stopping], 1).placed
    extra = [{**as_alloc(job, p), "ID": "e0"}]

    job, group = make_job("next", gpus=2, cpu=8000, memory=32768, count=3)
    from_list = place_group(job, group, nodes, [a for a in live if a["ID"] not in stopping] + extra, 3)
    from_view = place_group(job, group, nodes, UsageView(store.live_usage, stopping, extra), 3)
    assert [q.node_id for q in from_view.placed] == [q.node_id for q in from_list.placed]
    assert [q.metrics["ScoreMetaData"] for q in from_view.placed] == [
        q.metrics["ScoreMetaData"] for q in from_list.placed
    ]
    view = UsageView(store.live_usage, stopping, extra)
    ports = {m["Value"] for a in live for m in a["AllocatedResources"]["Shared"]["Ports"] or []}
    for a in live:
        for port in {m["Value"] for m in a["AllocatedResources"]["Shared"]["Ports"] or []}:
            assert (port in view) == (a["ID"] not in stopping)
    assert ports
