"""One model's trouble stays that model's: a state that makes its reconcile raise, or a write of
its state that Consul fails, is logged with the model's name and shown on that model, and every
other model is reconciled and acted on as usual. Without this, one odd value in one key (a valid
JSON number no clock can show) stopped every pass for the whole fleet."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from nomad_driver.state import ModelState
from nomad_driver.watcher.decisions import Decision, ModelView
from nomad_driver.watcher.reconcile import reconcile

log = logging.getLogger("llmgw.watcher")


class BrokenModels:
    """The models whose last reconcile or apply failed, and why; each failure is logged when it
    starts or its words change, not on every pass."""

    def __init__(self) -> None:
        self.why: dict[str, str] = {}

    def failed(self, model: str, stage: str, exc: BaseException) -> str:
        why = f"{stage} failed: {type(exc).__name__}: {exc}"
        if self.why.get(model) != why:
            log.error("event=model_%s_failed model=%s error=%r", stage, model, why, exc_info=exc)
        self.why[model] = why
        return why

    def succeeded(self, model: str, stage: str) -> None:
        if self.why.get(model, "").startswith(f"{stage} failed"):
            log.info("event=model_%s_recovered model=%s", stage, model)
            del self.why[model]

    def keep_only(self, models: Mapping[str, object]) -> None:
        self.why = {m: w for m, w in self.why.items() if m in models}


def broken_decision(view: ModelView, previous: Decision | None, why: str) -> Decision:
    """No actions, and the model shown critical with the reason; counts as the last pass saw
    them, so nothing reads a broken model as suddenly empty."""
    state = view.state or ModelState()
    desired, ready, starting = (
        (previous.desired, previous.ready, previous.starting) if previous else (0, 0, 0)
    )
    return Decision(
        model=view.model.name,
        desired=desired,
        ready=ready,
        starting=starting,
        state=state,
        health="critical",
        health_output=f"llmgw cannot reconcile this model ({why}); its other models are unaffected",
        desired_reason=previous.desired_reason if previous else "min",
        desired_detail=previous.desired_detail if previous else "",
        recommendation=previous.recommendation if previous else 0,
    )


def reconcile_each(
    views: Mapping[str, ModelView],
    max_failures: int,
    previous: Mapping[str, Decision],
    broken: BrokenModels,
) -> dict[str, Decision]:
    decisions: dict[str, Decision] = {}
    for name, view in views.items():
        try:
            decisions[name] = reconcile(view, max_failures)
        except Exception as exc:  # any model's odd state; the others go on
            decisions[name] = broken_decision(view, previous.get(name), broken.failed(name, "reconcile", exc))
        else:
            broken.succeeded(name, "reconcile")
    return decisions
