"""`/v1/jobs/parse`: llmgw's own jobspecs (jobs/local/*.nomad.hcl) turned into API jobs by the
stand-in, then registered and placed, as `nomad job run` does on the client side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nomad
import pytest

from devstack.ports import free_port
from tests.fixtures.nomad import REPO, StandIn
from tests.standin.api_helpers import eval_done, live_allocs, wait_for

LOCAL_JOBS = sorted((REPO / "jobs" / "local").glob("*.nomad.hcl"))


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose `bin/llmgw` only sleeps: the jobs' raw_exec tasks start, and nothing else
    runs (the real router, watcher and agent have their own tests)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    llmgw = venv / "bin" / "llmgw"
    llmgw.write_text("#!/bin/sh\nexec sleep 3600\n")
    llmgw.chmod(0o755)
    return venv


def variables_for(path: Path, venv: Path, standin: StandIn) -> str:
    text = path.read_text()
    values = {"venv": str(venv), "nomad_addr": standin.url, "consul_addr": "http://127.0.0.1:1"}
    if 'variable "port"' in text:
        values["port"] = str(free_port())
    if 'variable "admin_port"' in text:
        values["admin_port"] = str(free_port())
    lines = []
    for name, value in values.items():
        if f'variable "{name}"' in text:
            lines.append(f"{name} = {value}" if value.isdigit() else f'{name} = "{value}"')
    return "\n".join(lines) + "\n"


def parse(standin: StandIn, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{standin.url}/v1/jobs/parse", json=body, timeout=10)


def test_llmgw_jobspecs_exist() -> None:
    names = {p.name for p in LOCAL_JOBS}
    assert {"llmgw-node-agent.nomad.hcl", "llmgw-router.nomad.hcl", "llmgw-watcher.nomad.hcl"} <= names


@pytest.mark.parametrize("path", LOCAL_JOBS, ids=lambda p: p.name)
def test_local_jobspec_parses_and_registers(standin: StandIn, tmp_path: Path, path: Path) -> None:
    venv = fake_venv(tmp_path)
    response = parse(
        standin,
        {"JobHCL": path.read_text(), "Variables": variables_for(path, venv, standin), "Canonicalize": True},
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert "Job" not in job, "the answer is the bare Job"
    assert job["ID"] == path.name.removesuffix(".nomad.hcl")
    assert job["Region"] == "global" and job["Namespace"] == "default"  # canonicalised
    task = job["TaskGroups"][0]["Tasks"][0]
    assert task["Config"]["command"] == f"{venv}/bin/llmgw"

    client = standin.client()
    result = client.jobs.register_job({"Job": job})
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["Status"] == "complete" and evaluation["FailedTGAllocs"] is None, evaluation
    want = (
        len(client.nodes.get_nodes())
        if job["Type"] == "system"
        else sum(g["Count"] for g in job["TaskGroups"])
    )
    allocs = wait_for(
        lambda: live_allocs(client, job["ID"]) if len(live_allocs(client, job["ID"])) == want else None,
        what=f"{want} allocations of {job['ID']}",
    )
    if job["Type"] == "system":
        assert len({a["NodeID"] for a in allocs}) == want
    wait_for(
        lambda: all(a["ClientStatus"] == "running" for a in live_allocs(client, job["ID"])),
        what=f"{job['ID']} running",
    )


def test_parse_without_canonicalize_leaves_defaults_unset(standin: StandIn, tmp_path: Path) -> None:
    path = REPO / "jobs" / "local" / "llmgw-node-agent.nomad.hcl"
    venv = fake_venv(tmp_path)
    job = parse(standin, {"JobHCL": path.read_text(), "Variables": variables_for(path, venv, standin)}).json()
    assert job["Type"] == "system"
    assert "Region" not in job or job["Region"] in (None, "")
    # python-nomad's own call reaches the same endpoint (no variables, so it must fail cleanly).
    with pytest.raises(nomad.api.exceptions.BadRequestNomadException) as err:
        standin.client().jobs.parse(path.read_text())
    assert "Failed to parse job" in err.value.nomad_resp.text


def test_parse_errors(standin: StandIn) -> None:
    empty = parse(standin, {"JobHCL": "  "})
    assert (empty.status_code, empty.text) == (400, "Job spec is empty")
    broken = parse(standin, {"JobHCL": 'job "x" { group "g" {'})
    assert broken.status_code == 400 and broken.text.startswith("Failed to parse job: ")
    # Not strict, as Nomad's endpoint is not (test_strict_variables.py): the value is dropped.
    undeclared = parse(standin, {"JobHCL": 'job "x" {\n}\n', "Variables": 'nope = "1"\n'})
    assert undeclared.status_code == 200, undeclared.text
    assert httpx.get(f"{standin.url}/v1/jobs/parse").status_code == 405


# The blocks and attributes `nomad init` writes into its example job (command/asset/
# example.nomad.hcl): a job-level update, migrate and ui, a group with network, service, restart
# and ephemeral_disk, and a docker task with an identity and a shutdown delay.
INIT_EXAMPLE = """
job "example" {
  datacenters = ["*"]
  type = "service"

  update {
    max_parallel      = 1
    min_healthy_time  = "10s"
    healthy_deadline  = "3m"
    progress_deadline = "10m"
    auto_revert       = false
    canary            = 0
  }

  migrate {
    max_parallel     = 1
    health_check     = "checks"
    min_healthy_time = "10s"
    healthy_deadline = "5m"
  }

  ui {
    description = "An *example* job"
    link {
      label = "Docs"
      url   = "https://example.com/docs"
    }
  }

  group "cache" {
    count = 1

    network {
      port "db" {
        to = 6379
      }
    }

    service {
      name     = "cache"
      tags     = ["cache"]
      port     = "db"
      provider = "nomad"
    }

    restart {
      attempts = 2
      interval = "30m"
      delay    = "15s"
      mode     = "fail"
    }

    ephemeral_disk {
      size = 300
    }

    task "redis" {
      driver = "docker"

      config {
        image          = "redis:7"
        ports          = ["db"]
        auth_soft_fail = true
      }

      shutdown_delay = "10s"

      identity {
        env  = true
        file = true
      }

      resources {
        cpu    = 500 # MHz
        memory = 256 # MB
      }
    }
  }
}
"""
S = 1_000_000_000


def test_nomad_init_example_parses_with_every_block(standin: StandIn) -> None:
    response = parse(standin, {"JobHCL": INIT_EXAMPLE})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["Update"] == {
        "Stagger": None,
        "MaxParallel": 1,
        "HealthCheck": None,
        "MinHealthyTime": 10 * S,
        "HealthyDeadline": 180 * S,
        "ProgressDeadline": 600 * S,
        "Canary": 0,
        "AutoRevert": False,
        "AutoPromote": None,
    }
    assert job["Migrate"] == {
        "MaxParallel": 1,
        "HealthCheck": "checks",
        "MinHealthyTime": 10 * S,
        "HealthyDeadline": 300 * S,
    }
    assert job["UI"] == {
        "Description": "An *example* job",
        "Links": [{"Label": "Docs", "URL": "https://example.com/docs"}],
    }
    (group,) = job["TaskGroups"]
    # Parsed alone, the job's update stays the job's: the group has none of its own.
    assert "Update" not in group
    assert group["RestartPolicy"] == {
        "Attempts": 2,
        "Interval": 1800 * S,
        "Delay": 15 * S,
        "Mode": "fail",
        "RenderTemplates": None,
    }
    (task,) = group["Tasks"]
    assert task["ShutdownDelay"] == 10 * S
    assert task["Identity"]["Env"] is True and task["Identity"]["File"] is True
    assert task["Identities"] is None
    assert group["Networks"][0]["DynamicPorts"] == [{"Label": "db", "Value": 0, "To": 6379}]

    canonical = parse(standin, {"JobHCL": INIT_EXAMPLE, "Canonicalize": True}).json()
    update = canonical["TaskGroups"][0]["Update"]
    # Canonicalised, each group inherits the job's update over Nomad's defaults.
    assert (update["ProgressDeadline"], update["HealthyDeadline"], update["HealthCheck"]) == (
        600 * S,
        180 * S,
        "checks",
    )
    assert canonical["TaskGroups"][0]["Migrate"]["HealthyDeadline"] == 300 * S


BLOCKS = """
job "blocks" {
  reschedule {
    attempts  = 3
    interval  = "1h"
    unlimited = false
  }
  group "g" {
    scaling {
      min     = 0
      max     = 4
      enabled = false
      policy {
        cooldown = "1m"
      }
    }
    task "t" {
      driver = "mock_driver"
      restart {
        attempts = 0
        mode     = "fail"
      }
      identity {
        name = "vault_default"
        aud  = ["vault.io"]
        ttl  = "1h"
      }
      affinity {
        attribute = "${node.class}"
        value     = "h100"
        weight    = 40
      }
    }
  }
}
"""


def test_blocks_that_were_dropped_are_parsed_into_nomads_json(standin: StandIn) -> None:
    response = parse(standin, {"JobHCL": BLOCKS})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["Reschedule"] == {
        "Attempts": 3,
        "Interval": 3600 * S,
        "Delay": None,
        "DelayFunction": None,
        "MaxDelay": None,
        "Unlimited": False,
    }
    group = job["TaskGroups"][0]
    assert group["Scaling"] == {
        "Min": 0,
        "Max": 4,
        "Policy": {"cooldown": "1m"},
        "Enabled": False,
        "Type": "",
    }
    task = group["Tasks"][0]
    assert task["RestartPolicy"] == {
        "Attempts": 0,
        "Interval": None,
        "Delay": None,
        "Mode": "fail",
        "RenderTemplates": None,
    }
    assert task["Identity"] is None
    (named,) = task["Identities"]
    assert (named["Name"], named["Audience"], named["TTL"]) == ("vault_default", ["vault.io"], 3600 * S)
    assert task["Affinities"] == [
        {"LTarget": "${node.class}", "RTarget": "h100", "Operand": "=", "Weight": 40}
    ]

    canonical = parse(standin, {"JobHCL": BLOCKS, "Canonicalize": True}).json()
    policy = canonical["TaskGroups"][0]["ReschedulePolicy"]
    assert (policy["Attempts"], policy["Interval"], policy["Unlimited"]) == (3, 3600 * S, False)
    task = canonical["TaskGroups"][0]["Tasks"][0]
    # A task's restart is merged over its group's, as the API's Canonicalize does.
    assert (task["RestartPolicy"]["Attempts"], task["RestartPolicy"]["Delay"]) == (0, 15 * S)


@pytest.mark.parametrize(
    ("hcl", "named"),
    [
        ('job "x" {\n  update {\n    max_paralel = 2\n  }\n}\n', "update has max_paralel"),
        ('job "x" {\n  vault {\n  }\n}\n', "job has vault"),
        ('job "x" {\n group "g" {\n  scaling {\n   minimum = 1\n  }\n }\n}\n', "scaling has minimum"),
        (
            'job "x" {\n group "g" {\n  task "t" {\n   identity {\n    audience = ["a"]\n   }\n  }\n }\n}\n',
            "identity has audience",
        ),
        ('job "x" {\n group "g" {\n  task "t" {\n   csi_plugin {\n   }\n  }\n }\n}\n', "task has csi_plugin"),
        ('job "x" {\n  update {\n  }\n  update {\n  }\n}\n', "only one update block"),
    ],
)
def test_what_the_parser_does_not_know_is_refused_by_name(standin: StandIn, hcl: str, named: str) -> None:
    response = parse(standin, {"JobHCL": hcl})
    assert response.status_code == 400, response.text
    assert response.text.startswith("Failed to parse job: ") and named in response.text


# Every attribute of the blocks the parser used to read only in part (service, check, network and
# port, resources and device, template, artifact, ephemeral_disk, constraint shorthand), under the
# API names of Nomad's api/ structs (`ServiceCheck`, `CheckRestart`, `Port`, `Resources`,
# `Template`, `TaskArtifact`, `EphemeralDisk`).
FULL_BLOCKS = """
job "full" {
  meta = { team = "ml" }
  constraint {
    distinct_hosts = true
  }
  constraint {
    attribute = "${attr.kernel.name}"
    regexp    = "linux|darwin"
  }
  constraint {
    distinct_property = "${meta.rack}"
  }
  group "g" {
    network {
      mode     = "bridge"
      hostname = "engine"
      port "http" {
        to           = 8080
        host_network = "public"
      }
      port "admin" {
        static           = 9000
        ignore_collision = true
      }
      dns {
        servers = ["10.0.0.53"]
      }
    }
    service {
      name         = "web"
      port         = "http"
      address_mode = "alloc"
      on_update    = "ignore"
      canary_tags  = ["canary"]
      check_restart {
        limit = 3
        grace = "90s"
      }
      check {
        type                     = "http"
        path                     = "/health"
        interval                 = "5s"
        timeout                  = "1s"
        method                   = "POST"
        body                     = "{}"
        success_before_passing   = 2
        failures_before_critical = 4
        tls_skip_verify          = true
        header {
          Authorization = ["Basic x"]
        }
        check_restart {
          limit           = 2
          ignore_warnings = true
        }
      }
    }
    ephemeral_disk {
      sticky  = true
      migrate = true
      size    = 500
    }
    task "t" {
      driver = "mock_driver"
      env = { MODE = "fast" }
      resources {
        cpu        = 500
        cores      = 2
        memory     = 256
        memory_max = 512
        disk       = 100
        device "nvidia/gpu" {
          count = 2
          affinity {
            attribute = "${device.model}"
            regexp    = "H100"
            weight    = 75
          }
        }
        numa {
          affinity = "prefer"
        }
      }
      template {
        data          = "x={{ env \\"NOMAD_ALLOC_ID\\" }}"
        destination   = "local/x.env"
        change_mode   = "signal"
        change_signal = "SIGHUP"
        splay         = "3s"
        perms         = "0600"
        wait {
          min = "2s"
          max = "10s"
        }
      }
      artifact {
        source      = "https://example.com/model.gguf"
        destination = "local/model"
        mode        = "file"
        insecure    = false
        chown       = true
        headers {
          Authorization = "Bearer t"
        }
        options {
          checksum = "sha256:abc"
        }
      }
    }
  }
}
"""


def test_every_attribute_of_services_networks_resources_templates_and_artifacts_is_kept(
    standin: StandIn,
) -> None:
    response = parse(standin, {"JobHCL": FULL_BLOCKS})
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["Meta"] == {"team": "ml"}
    assert job["Constraints"] == [
        {"LTarget": "", "RTarget": "true", "Operand": "distinct_hosts"},
        {"LTarget": "${attr.kernel.name}", "RTarget": "linux|darwin", "Operand": "regexp"},
        {"LTarget": "${meta.rack}", "RTarget": "", "Operand": "distinct_property"},
    ]
    (group,) = job["TaskGroups"]
    (network,) = group["Networks"]
    assert (network["Mode"], network["Hostname"], network["DNS"]) == (
        "bridge",
        "engine",
        {"Servers": ["10.0.0.53"]},
    )
    assert network["DynamicPorts"] == [{"Label": "http", "Value": 0, "To": 8080, "HostNetwork": "public"}]
    assert network["ReservedPorts"] == [{"Label": "admin", "Value": 9000, "To": 0, "IgnoreCollision": True}]
    (service,) = group["Services"]
    assert (service["AddressMode"], service["OnUpdate"], service["CanaryTags"]) == (
        "alloc",
        "ignore",
        ["canary"],
    )
    assert service["CheckRestart"] == {"Limit": 3, "Grace": 90 * S}
    (check,) = service["Checks"]
    assert check["Header"] == {"Authorization": ["Basic x"]}
    assert check["CheckRestart"] == {"Limit": 2, "IgnoreWarnings": True}
    assert (check["Interval"], check["Timeout"], check["Method"], check["Body"]) == (5 * S, S, "POST", "{}")
    assert (check["SuccessBeforePassing"], check["FailuresBeforeCritical"], check["TLSSkipVerify"]) == (
        2,
        4,
        True,
    )
    assert group["EphemeralDisk"] == {"Sticky": True, "Migrate": True, "SizeMB": 500}
    (task,) = group["Tasks"]
    assert task["Env"] == {"MODE": "fast"}
    resources = task["Resources"]
    assert {k: resources[k] for k in ("CPU", "Cores", "MemoryMB", "MemoryMaxMB", "DiskMB")} == {
        "CPU": 500, "Cores": 2, "MemoryMB": 256, "MemoryMaxMB": 512, "DiskMB": 100,
    }  # fmt: skip
    assert resources["NUMA"] == {"Affinity": "prefer"}
    assert resources["Devices"] == [
        {
            "Name": "nvidia/gpu",
            "Count": 2,
            "Constraints": None,
            "Affinities": [
                {"LTarget": "${device.model}", "RTarget": "H100", "Operand": "regexp", "Weight": 75}
            ],
        }
    ]
    (template,) = task["Templates"]
    assert (template["ChangeMode"], template["ChangeSignal"], template["Splay"], template["Perms"]) == (
        "signal", "SIGHUP", 3 * S, "0600",
    )  # fmt: skip
    assert template["Wait"] == {"Min": 2 * S, "Max": 10 * S}
    assert template["EmbeddedTmpl"] == 'x={{ env "NOMAD_ALLOC_ID" }}'
    (artifact,) = task["Artifacts"]
    assert artifact == {
        "GetterSource": "https://example.com/model.gguf",
        "RelativeDest": "local/model",
        "GetterMode": "file",
        "GetterInsecure": False,
        "Chown": True,
        "GetterOptions": {"checksum": "sha256:abc"},
        "GetterHeaders": {"Authorization": "Bearer t"},
    }

    # Canonicalised, a service's check_restart reaches its check, under the check's own.
    canonical = parse(standin, {"JobHCL": FULL_BLOCKS, "Canonicalize": True}).json()
    (check,) = canonical["TaskGroups"][0]["Services"][0]["Checks"]
    assert check["CheckRestart"] == {"Limit": 2, "Grace": S, "IgnoreWarnings": True}
    assert canonical["TaskGroups"][0]["Tasks"][0]["Resources"]["MemoryMaxMB"] == 512


@pytest.mark.parametrize(
    ("block", "named"),
    [
        ("service {\n connect {\n }\n}", "service has connect"),
        ('service {\n check {\n  grpc_services = "x"\n }\n}', "check has grpc_services"),
        ("service {\n check {\n  check_restart {\n   limits = 1\n  }\n }\n}", "check_restart has limits"),
        ('network {\n port "p" {\n  statik = 80\n }\n}', "port has statik"),
        ("network {\n cni {\n }\n}", "network has cni"),
        ("ephemeral_disk {\n size_mb = 1\n}", "ephemeral_disk has size_mb"),
        ('task "t" {\n resources {\n  network {\n  }\n }\n}', "resources has network"),
        ('task "t" {\n resources {\n  device "gpu" {\n   cnt = 1\n  }\n }\n}', "device has cnt"),
        ('task "t" {\n template {\n  change_sig = "HUP"\n }\n}', "template has change_sig"),
        ('task "t" {\n artifact {\n  checksum = "x"\n }\n}', "artifact has checksum"),
        ('constraint {\n set_contains_any = "a"\n}', "constraint has set_contains_any"),
        ('task "t" {\n resources {\n }\n resources {\n }\n}', "only one resources block"),
        (
            'service {\n check {\n  header {\n   X = "one"\n  }\n }\n}',
            "a header's value is a list of strings",
        ),
    ],
)
def test_an_unknown_key_in_a_service_network_resources_template_or_artifact_is_refused(
    standin: StandIn, block: str, named: str
) -> None:
    hcl = f'job "x" {{\n group "g" {{\n{block}\n }}\n}}\n'
    response = parse(standin, {"JobHCL": hcl})
    assert response.status_code == 400, response.text
    assert response.text.startswith("Failed to parse job: ") and named in response.text
