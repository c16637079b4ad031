"""A scale Nomad refuses because the job's deployment is active (job_endpoint.go: 400 "job scaling
blocked due to active deployment") is held, not a refusal of the model: it is said once, not
asked again on every pass, and asked again once the job or its allocations change (the
deployment ending) or after a while."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from nomad_driver.nomad import NomadError
from nomad_driver.spec import parse_models
from nomad_driver.watcher.acting import DEPLOYMENT_BLOCKS_SCALE, DEPLOYMENT_RETRY_S, Actor
from nomad_driver.watcher.decisions import ModelView, Scale
from nomad_driver.watcher.reconcile import reconcile
from tests.test_reconcile import job, running
from tests.watcher_support import BARE_CPU_PROFILE

MODEL = parse_models(
    BARE_CPU_PROFILE
    + "models:\n  m:\n    source: file:///m.gguf\n    profile: cpu\n    replicas: {min: 1, max: 3}\n"
).models["m"]


class BlockedNomad:
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.blocked = True

    def scale(self, job_id: str, group: str, count: int, message: str) -> dict[str, Any]:
        self.calls.append(count)
        if self.blocked:
            raise NomadError(f"nomad POST /v1/job/{job_id}/scale: HTTP 400: {DEPLOYMENT_BLOCKS_SCALE}", 400)
        return {"EvalID": "e1"}


class Leading:
    is_leader = True

    def check_lease(self, what: str) -> None:
        pass


class States:
    async def write(self, model: str, state: Any, cas: int) -> bool:
        return True


def test_a_scale_blocked_by_an_active_deployment_is_held_then_asked_again_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    nomad = BlockedNomad()
    actor = Actor(nomad, Leading(), States(), None, lambda: now[0])  # type: ignore[arg-type]
    alloc = {**running("a", 5), "ModifyIndex": 10}
    view = ModelView(
        model=MODEL,
        job=job(MODEL, 1),
        allocs=(alloc,),
        ready=1,
        in_flight=3,
        in_flight_average=3.0,
        now=now[0],
    )
    d = reconcile(view)
    assert [a.count for a in d.actions if isinstance(a, Scale)] == [3]

    async def passes() -> list[Any]:
        out = []
        with caplog.at_level(logging.INFO, logger="llmgw.watcher"):
            out.append(await actor.apply_decision(MODEL, d, view))
            now[0] += 1
            out.append(await actor.apply_decision(MODEL, d, view))  # nothing changed: not asked
            # The deployment ends: its allocation turns healthy, a new ModifyIndex.
            nomad.blocked = False
            ended = dataclasses.replace(view, allocs=({**alloc, "ModifyIndex": 11},))
            out.append(await actor.apply_decision(MODEL, d, ended))
        return out

    first, second, third = asyncio.run(passes())
    assert nomad.calls == [3, 3]
    # Not a refusal of the model: nothing recorded, nothing shown as refused.
    assert first.state.last_action_error is None and second.state.last_action_error is None
    held = [r for r in caplog.records if "event=scale_held" in r.getMessage()]
    assert len(held) == 1 and "model=m" in held[0].getMessage()
    assert any("event=scaled model=m count=3" in r.getMessage() for r in caplog.records)
    assert "m" not in actor.held and third.state.last_action_error is None


def test_a_held_scale_is_asked_again_after_a_while_even_if_nothing_changed() -> None:
    now = [1000.0]
    nomad = BlockedNomad()
    actor = Actor(nomad, Leading(), States(), None, lambda: now[0])  # type: ignore[arg-type]
    view = ModelView(model=MODEL, job=job(MODEL, 1), ready=1, in_flight=3, in_flight_average=3.0, now=now[0])
    d = reconcile(view)

    async def passes() -> None:
        await actor.apply_decision(MODEL, d, view)
        now[0] += DEPLOYMENT_RETRY_S + 1
        await actor.apply_decision(MODEL, d, view)

    asyncio.run(passes())
    assert nomad.calls == [3, 3]
