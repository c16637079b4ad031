"""The scheduler configuration (`/v1/operator/scheduler/configuration`,
`nomad operator scheduler set-config`; `nomad/structs/operator.go`, `operator_endpoint.go`).

The stand-in acts on one setting, `RejectJobRegistration`: Nomad's load-shedding switch, which
refuses every job registration and scale that does not come with a management token. The
stand-in runs without ACLs, and Nomad's ACL object for "ACLs disabled" is no management token,
so with the switch on every register and scale is refused, with Nomad's 403. `PreemptionConfig`
is kept and shown (the stand-in never preempts, whatever it says); turning on spread,
memory oversubscription or a paused broker is refused in the stand-in's own words, rather than
accepted and silently not done.
"""

from __future__ import annotations

import copy
from typing import Any

Json = dict[str, Any]

# structs.ErrJobRegistrationDisabled; Nomad's HTTP layer answers it with 403.
ERR_REGISTRATION_DISABLED = (
    "Job registration, dispatch, and scale are disabled by the scheduler configuration"
)

DEFAULTS: Json = {
    "SchedulerAlgorithm": "binpack",
    "PreemptionConfig": {
        "SystemSchedulerEnabled": True,
        "SysBatchSchedulerEnabled": False,
        "BatchSchedulerEnabled": False,
        "ServiceSchedulerEnabled": False,
    },
    "MemoryOversubscriptionEnabled": False,
    "RejectJobRegistration": False,
    "PauseEvalBroker": False,
}
_MODELLED = {"RejectJobRegistration", "PreemptionConfig"}


class SchedulerConfigError(ValueError):
    """A set-config body Nomad would refuse (400), or a setting the stand-in does not model."""


class SchedulerConfiguration:
    def __init__(self) -> None:
        self.config: Json = {**copy.deepcopy(DEFAULTS), "CreateIndex": 0, "ModifyIndex": 0}

    @property
    def rejects_registration(self) -> bool:
        return bool(self.config["RejectJobRegistration"])

    def get(self) -> Json:
        return copy.deepcopy(self.config)

    def set(self, body: Any, cas: int | None, index: int) -> bool:
        """`Operator.SchedulerSetConfiguration`: the body replaces the whole configuration (a
        field left out is its zero value, as Go decodes it). With `cas`, only if the stored
        `ModifyIndex` is that. Returns whether it was updated."""
        if not isinstance(body, dict):
            raise SchedulerConfigError("Error parsing scheduler config: body must be a JSON object")
        algorithm = body.get("SchedulerAlgorithm") or "binpack"  # Canonicalize
        if algorithm not in ("binpack", "spread"):
            raise SchedulerConfigError(f"invalid scheduler algorithm: {algorithm}")
        zero_preemption = dict.fromkeys(DEFAULTS["PreemptionConfig"], False)
        wanted: Json = {
            "SchedulerAlgorithm": algorithm,
            "PreemptionConfig": {**zero_preemption, **(body.get("PreemptionConfig") or {})},
            "MemoryOversubscriptionEnabled": bool(body.get("MemoryOversubscriptionEnabled")),
            "RejectJobRegistration": bool(body.get("RejectJobRegistration")),
            "PauseEvalBroker": bool(body.get("PauseEvalBroker")),
        }
        for key, value in wanted.items():
            if key not in _MODELLED and value != DEFAULTS[key] and value != self.config[key]:
                raise SchedulerConfigError(
                    f"the stand-in does not model {key} = {value!r}; of the scheduler configuration it acts "
                    "on RejectJobRegistration only"
                )
        if cas is not None and cas != self.config["ModifyIndex"]:
            return False
        created = self.config["CreateIndex"] or index
        self.config = {**wanted, "CreateIndex": created, "ModifyIndex": index}
        return True
