"""The scheduler configuration (`/v1/operator/scheduler/configuration`) and its one setting the
stand-in acts on, Nomad's load-shedding switch `RejectJobRegistration`: with it on and no ACLs
(so no management token), every register and scale is refused with Nomad's 403."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import requests

from devstack.nomad.operator import ERR_REGISTRATION_DISABLED
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import mock_job


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def config_url(standin: StandIn) -> str:
    return f"{standin.url}/v1/operator/scheduler/configuration"


def test_rejecting_registrations_refuses_register_and_scale_with_nomads_403(standin: StandIn) -> None:
    register = f"{standin.url}/v1/jobs"
    assert requests.put(register, json=mock_job("before"), timeout=10).status_code == 200
    got = requests.get(config_url(standin), timeout=10).json()
    assert got["SchedulerConfig"]["RejectJobRegistration"] is False
    assert got["SchedulerConfig"]["SchedulerAlgorithm"] == "binpack"
    current = got["SchedulerConfig"]

    # `nomad operator scheduler set-config -reject-job-registration=true` sends the whole config.
    answer = requests.put(config_url(standin), json={**current, "RejectJobRegistration": True}, timeout=10)
    assert answer.status_code == 200 and answer.json()["Updated"] is True
    index = answer.json()["Index"]
    shown = requests.get(config_url(standin), timeout=10)
    assert shown.json()["SchedulerConfig"]["RejectJobRegistration"] is True
    assert shown.json()["SchedulerConfig"]["ModifyIndex"] == index == int(shown.headers["X-Nomad-Index"])

    refused = requests.put(register, json=mock_job("after"), timeout=10)
    assert (refused.status_code, refused.text) == (403, ERR_REGISTRATION_DISABLED)
    body = {"Count": 0, "Target": {"Group": "g"}}
    refused = requests.post(f"{standin.url}/v1/job/before/scale", json=body, timeout=10)
    assert (refused.status_code, refused.text) == (403, ERR_REGISTRATION_DISABLED)
    # Reads go on as usual.
    assert requests.get(f"{standin.url}/v1/job/before", timeout=10).status_code == 200

    # A stale check-and-set changes nothing; the current one does.
    stale = requests.put(f"{config_url(standin)}?cas={index - 1}", json=current, timeout=10)
    assert stale.json()["Updated"] is False
    again = requests.put(f"{config_url(standin)}?cas={index}", json=current, timeout=10)
    assert again.json()["Updated"] is True
    assert requests.put(register, json=mock_job("after"), timeout=10).status_code == 200


def test_settings_the_stand_in_does_not_act_on_are_refused_not_ignored(standin: StandIn) -> None:
    spread = requests.put(config_url(standin), json={"SchedulerAlgorithm": "spread"}, timeout=10)
    assert spread.status_code == 400 and "does not model SchedulerAlgorithm" in spread.text
    typo = requests.put(config_url(standin), json={"SchedulerAlgorithm": "pack"}, timeout=10)
    assert (typo.status_code, typo.text) == (400, "invalid scheduler algorithm: pack")
    assert requests.get(config_url(standin), timeout=10).json()["SchedulerConfig"]["SchedulerAlgorithm"] == (
        "binpack"
    )
