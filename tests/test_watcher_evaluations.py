"""Evaluations per job (watcher/evaluations.py), on the stand-in's real HTTP API: an evaluation
of one job never lists the namespace's evaluations again, the jobs a pass decides from are read
whole with `GET /v1/job/<id>/evaluations`, and "fits nowhere" still comes with its reason."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from nomad_driver.nomad import Nomad
from nomad_driver.placement import latest_placement_failure
from nomad_driver.spec import parse_models
from nomad_driver.state import Ask, ModelState
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.evaluations import EvaluationFeed, jobs_needing_evaluations
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import NO_DEPLOYMENTS, mock_job, scale
from tests.test_watcher_feeds import WAIT_S, until

Json = dict[str, Any]


class CountingNomad(Nomad):
    """Counts the namespace-wide evaluation lists and the per-job reads."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: Counter[str] = Counter()

    def blocking_list(self, collection: str, **kw: Any) -> tuple[int, list[dict[str, Any]]]:
        self.calls[f"list {collection}"] += 1
        return super().blocking_list(collection, **kw)

    def job_evaluations(self, job_id: str) -> list[dict[str, Any]]:
        self.calls[f"job {job_id}"] += 1
        return super().job_evaluations(job_id)


def of_job(evals: tuple[Json, ...], job_id: str) -> list[Json]:
    return [e for e in evals if e.get("JobID") == job_id]


async def test_an_evaluation_of_one_job_never_lists_the_namespace_again(nomad_standin: StandIn) -> None:
    client = nomad_standin.client()
    for name in ("llmgw-quiet", "llmgw-busy", "tenant"):
        client.jobs.register_job(mock_job(name, **NO_DEPLOYMENTS))
    nomad = CountingNomad(nomad_standin.url)
    feed = EvaluationFeed(nomad, WAIT_S)
    try:
        index, held = await until(feed.fetch, 0, lambda e: of_job(e, "llmgw-busy"))
        assert {e["JobID"] for e in held} == {"llmgw-quiet", "llmgw-busy"}  # llmgw's only
        assert nomad.calls["list evaluations"] == 1

        # A job no decision reads: its evaluation comes in with its event, for free.
        before = len(of_job(held, "llmgw-busy"))
        scale(client, "llmgw-busy", "g", 2)
        index, held = await until(feed.fetch, index, lambda e: len(of_job(e, "llmgw-busy")) > before)
        assert nomad.calls["job llmgw-busy"] == 0

        # A job a pass decides from: read whole, that job alone.
        feed.needed = frozenset({"llmgw-busy"})
        before = len(of_job(held, "llmgw-busy"))
        scale(client, "llmgw-busy", "g", 3)
        index, held = await until(feed.fetch, index, lambda e: len(of_job(e, "llmgw-busy")) > before)
        assert nomad.calls["job llmgw-busy"] >= 1 and feed.job_reads >= 1
        assert nomad.calls["job llmgw-quiet"] == 0

        # Another team's job's evaluations are neither listed nor read, nor wake a pass.
        client.jobs.register_job(mock_job("tenant", count=2, **NO_DEPLOYMENTS))
        scale(client, "llmgw-quiet", "g", 2)
        _, held = await until(feed.fetch, index, lambda e: len(of_job(e, "llmgw-quiet")) > 1)
        assert not of_job(held, "tenant")

        assert nomad.calls["list evaluations"] == 1, "a change listed the namespace's evaluations again"
        assert feed.lists == 1
    finally:
        feed.close()


async def test_another_jobs_evaluation_keeps_the_index_and_an_llmgw_one_moves_it(
    nomad_standin: StandIn,
) -> None:
    """Every job's evaluations come down the stream; only llmgw's wake a pass."""
    client = nomad_standin.client()
    feed = EvaluationFeed(Nomad(nomad_standin.url), WAIT_S)
    try:
        index, evals = await feed.fetch(0)
        assert evals == ()
        client.jobs.register_job(mock_job("tenant", **NO_DEPLOYMENTS))
        started = time.monotonic()
        again, evals = await feed.fetch(index)
        assert again == index and evals == ()
        assert time.monotonic() - started < WAIT_S, "answered by the wait running out, not the event"

        client.jobs.register_job(mock_job("llmgw-evals", **NO_DEPLOYMENTS))
        moved, evals = await until(feed.fetch, again, lambda e: of_job(e, "llmgw-evals"))
        assert moved > index
        assert {e["JobID"] for e in evals} == {"llmgw-evals"}
    finally:
        feed.close()


async def test_a_job_that_fits_nowhere_is_read_whole_and_says_why(nomad_standin: StandIn) -> None:
    client = nomad_standin.client()
    nomad = CountingNomad(nomad_standin.url)
    feed = EvaluationFeed(nomad, WAIT_S)
    feed.needed = frozenset({"llmgw-huge"})
    try:
        index, _ = await feed.fetch(0)
        # More memory than any node has: Nomad's evaluation fails to place it, and blocks.
        client.jobs.register_job(mock_job("llmgw-huge", memory_mb=10_000_000, **NO_DEPLOYMENTS))
        _, held = await until(
            feed.fetch, index, lambda e: latest_placement_failure(of_job(e, "llmgw-huge")) is not None
        )
        failure = latest_placement_failure(of_job(held, "llmgw-huge"))
        assert failure is not None and "memory" in failure.reason
        assert nomad.calls["job llmgw-huge"] >= 1
        assert nomad.calls["list evaluations"] == 1
    finally:
        feed.close()


MODELS = parse_models(
    """profiles:
  gpu: {engine: llama.cpp, engine_version: b1, gpus: 1}
models:
  placed: {source: "file:///m/a.gguf", profile: gpu, replicas: {min: 1, max: 2}}
  waiting: {source: "file:///m/b.gguf", profile: gpu, replicas: {min: 1, max: 2}}
  refused: {source: "file:///m/c.gguf", profile: gpu, replicas: {min: 0, max: 1}}
  absent: {source: "file:///m/d.gguf", profile: gpu, replicas: {min: 1, max: 1}}
"""
).models


def job(job_id: str, count: int) -> Json:
    return {"ID": job_id, "TaskGroups": [{"Name": "engine", "Count": count}]}


def alloc(status: str) -> Json:
    return {"ClientStatus": status, "DesiredStatus": "run"}


@pytest.mark.parametrize("asked", [False, True])
def test_only_the_models_a_decision_reads_evaluations_for_need_them(asked: bool) -> None:
    views = [
        ModelView(MODELS["placed"], job("llmgw-placed", 1), (alloc("running"), alloc("failed"))),
        ModelView(MODELS["waiting"], job("llmgw-waiting", 2), (alloc("running"),)),
        ModelView(
            MODELS["refused"],
            job("llmgw-refused", 0),
            state=ModelState(unplaceable=True, placement_reason="x"),
        ),
        ModelView(MODELS["absent"]),
    ]
    if asked:
        views[0] = ModelView(
            MODELS["placed"], job("llmgw-placed", 1), (alloc("running"),), asks=(Ask("r", 1, 1.0),)
        )
    needed = jobs_needing_evaluations(views)
    assert needed == {"llmgw-waiting", "llmgw-refused"} | ({"llmgw-placed"} if asked else set())
