"""`devstack up --s3 --acl`: the dev stack attaches the policy docs/models.md asks operators for,
read on `llmgw/sources/tiny-s3`, to both of the model's job IDs, so the fetch task's template may
read the keys with its workload identity."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from devstack import s3_weights
from devstack.nomad.acl import ACL, Claim, parse_rules
from devstack.stack import Stack, UpOptions
from nomad_driver.variables import source_variable_path
from tests.fixtures.nomad import StandIn

BOOTSTRAP = "6b7a2f5e-0000-4000-8000-00000000b007"


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False, extra_args=["--acl-bootstrap-token", BOOTSTRAP])


def test_the_keys_and_the_policies_for_both_job_ids_are_written(standin: StandIn) -> None:
    weights = s3_weights.S3Weights("http://127.0.0.1:9", "AKIA-DEV", "secret", 0, Path("/dev/null"))
    s3_weights.put_keys(standin.url, weights, BOOTSTRAP, None)
    path = source_variable_path(s3_weights.MODEL)
    headers = {"X-Nomad-Token": BOOTSTRAP}
    for job in ("llmgw-tiny-s3", "llmgw-tiny-s3~b"):
        names = [p["Name"] for p in httpx.get(f"{standin.url}/v1/acl/policies", headers=headers).json()]
        attached = [
            httpx.get(f"{standin.url}/v1/acl/policy/{n}", headers=headers).json()
            for n in names
            if n.startswith("llmgw-source-")
        ]
        mine = [p for p in attached if (p.get("JobACL") or {}).get("JobID") == job]
        assert len(mine) == 1, attached
        claim = Claim("default", job, "engine", "fetch")
        acl = ACL([parse_rules(mine[0]["Rules"])])
        assert acl.allow_variable("default", path, "read", claim)
        assert not acl.allow_variable("default", source_variable_path("other"), "read", claim)


def test_s3_with_acl_is_no_longer_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = Stack(UpOptions(state_dir=tmp_path, s3=True, acl=True, nomad="standin"), say=lambda *a: None)
    monkeypatch.setattr(
        s3_weights, "start", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("moto reached"))
    )
    with pytest.raises(RuntimeError, match="moto reached"):
        s3_weights.set_up(stack)
