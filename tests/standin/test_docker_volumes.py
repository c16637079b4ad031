"""The docker plugin's `volumes.enabled = false` default, applied by the stand-in's client when a
`docker` task starts, and set per node in the nodes file as a client's `plugin "docker"` block.

Sources in hashicorp/nomad: drivers/docker/config.go (the `volumes` block defaults to
`enabled = false`), drivers/docker/driver.go (`StartTask` wraps the container config error as
`Failed to create container configuration for image %q (%q): %v`; `containerBinds` refuses a host
path with "volumes are not enabled; cannot mount host path: %q"), drivers/docker/fingerprint.go
(a client with volumes on reports the attribute `driver.docker.volumes.enabled`), and
client/allocrunner/taskrunner/task_runner.go (the start error becomes a "Driver Failure" event;
it is not recoverable, so the task is not restarted).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.nomad.nodes import NodeSpecError, node_from_spec
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import tiny_node, wait_for

VOLUMES_ON = {"docker": {"config": {"volumes": {"enabled": True}}}}
BIND = "/etc/llmgw/tls:/llmgw/tls:ro"


def docker_job(job_id: str, node: str, volumes: list[str]) -> dict[str, Any]:
    task = {
        "Name": "t",
        "Driver": "docker",
        "Config": {"image": "ghcr.io/llmgw/llmgw:1", "volumes": volumes},
        "Resources": {"CPU": 100, "MemoryMB": 64},
    }
    constraint = {"LTarget": "${node.unique.name}", "RTarget": node, "Operand": "="}
    group = {"Name": "g", "Count": 1, "Tasks": [task], "Constraints": [constraint]}
    return {"Job": {"ID": job_id, "Type": "batch", "TaskGroups": [group]}}


@pytest.fixture
def standin(start_standin: Callable[..., StandIn], tmp_path: Path) -> StandIn:
    nodes = [tiny_node("default-plugin", plugins={"docker": {}}), tiny_node("volumes-on", plugins=VOLUMES_ON)]
    path = tmp_path / "docker.yaml"
    path.write_text(yaml.safe_dump({"nodes": nodes}))
    return start_standin(nodes=path, consul=False)


def task_state(standin: StandIn, job_id: str, want: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    client = standin.client()

    def found() -> dict[str, Any] | None:
        for stub in client.job.get_allocations(job_id):
            state = (client.allocation.get_allocation(stub["ID"]).get("TaskStates") or {}).get("t")
            if state and want(state):
                return dict(state)
        return None

    return wait_for(found, 15, f"{job_id}'s task")


def test_a_host_path_is_refused_on_a_node_whose_plugin_keeps_the_default(standin: StandIn) -> None:
    standin.client().jobs.register_job(docker_job("mounts", "default-plugin", [BIND]))
    state = task_state(standin, "mounts", lambda s: s["State"] == "dead")
    failure = next(e for e in state["Events"] if e["Type"] == "Driver Failure")
    assert failure["DriverError"].startswith(
        'Failed to create container configuration for image "ghcr.io/llmgw/llmgw:1" ('
    )
    assert failure["DriverError"].endswith(f'): volumes are not enabled; cannot mount host path: "{BIND}"')
    assert state["Failed"] is True
    assert [e["Type"] for e in state["Events"]].count("Restarting") == 0


def test_the_same_task_starts_where_the_node_enables_volumes(standin: StandIn) -> None:
    standin.client().jobs.register_job(docker_job("mounts-ok", "volumes-on", [BIND]))
    state = task_state(standin, "mounts-ok", lambda s: s["State"] == "running")
    assert "Driver Failure" not in [e["Type"] for e in state["Events"]]


def test_a_path_inside_the_allocation_needs_no_opt_in(standin: StandIn) -> None:
    standin.client().jobs.register_job(docker_job("local", "default-plugin", ["local/cfg:/etc/cfg"]))
    task_state(standin, "local", lambda s: s["State"] == "running")


def test_the_plugin_config_shows_as_nomads_fingerprint_and_is_checked() -> None:
    on = node_from_spec(tiny_node("a", plugins=VOLUMES_ON))
    assert on["Attributes"]["driver.docker"] == "true"
    assert on["Attributes"]["driver.docker.volumes.enabled"] == "true"
    assert on["Drivers"]["docker"]["Healthy"] is True
    off = node_from_spec(tiny_node("b", plugins={"docker": {}}))
    assert "driver.docker.volumes.enabled" not in off["Attributes"]
    with pytest.raises(NodeSpecError, match=r"node 'c': plugins.docker.config: unknown key 'privileged'"):
        node_from_spec(tiny_node("c", plugins={"docker": {"config": {"privileged": {"enabled": True}}}}))
