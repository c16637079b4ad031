"""The dev stack's Prometheus configuration: generated from the shipped files, checked by the
real promtool. The running server is tested end to end in tests/e2e/test_where_operators_look.py."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from devstack import processes, services
from devstack import prometheus as prom
from devstack.ports import free_port
from tests.fixtures.nomad import StandIn
from tests.test_alert_rules import run_promtool
from tests.test_jobspecs import parse as parse_jobspec_file


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check config` of the server the dev stack runs: bookworm's promtool, which the
    rule tests use, comes from a build without Consul discovery and refuses `consul_sd_configs`."""
    promtool = Path(prom.find_prometheus_binary()).with_name("promtool")
    return subprocess.run(
        [str(promtool), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )


def rules(text: str) -> list[dict]:
    return [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]


def test_shipped_scrape_configuration_passes_promtool() -> None:
    # Its rule_files entry is relative to the file: the shipped rules beside it.
    result = check_config(prom.SHIPPED_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_shipped_scrape_configuration_finds_llmgw_by_its_metrics_tag() -> None:
    config = yaml.safe_load(prom.SHIPPED_CONFIG.read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["consul_sd_configs"]
    assert set(sd["services"]) == {"llmgw-watcher", "llmgw-router", "llmgw-node-agent"}
    assert sd["tags"] == ["metrics"]
    jobs = Path(prom.SHIPPED_CONFIG).parents[1]
    for name in sd["services"]:
        for path in (jobs / f"{name}.nomad.hcl", jobs / "local" / f"{name}.nomad.hcl"):
            # The jobspec as Nomad reads it (HCL to API JSON), not its text: a tag in a comment
            # or on another service registers nothing Prometheus can find.
            registered = {
                service["Name"]: service.get("Tags") or []
                for group in parse_jobspec_file(path)["TaskGroups"]
                for service in group.get("Services") or []
            }
            assert name in registered, f"{path} registers no service {name!r}: {sorted(registered)}"
            assert "metrics" in registered[name], f"{path}: {name} is registered without the metrics tag"


def test_generated_rules_cut_only_longer_for_and_keep_everything_else(tmp_path: Path) -> None:
    shipped = prom.SHIPPED_RULES.read_text()
    generated = prom.rules_with_for(shipped, "3m")
    for old, new in zip(rules(shipped), rules(generated), strict=True):
        old_for, new_for = old.pop("for", None), new.pop("for", None)
        if old_for is None:
            assert new_for is None, f"{old['alert']}: an alert that fires at once was given a for:"
        elif prom.parse_duration(old_for) > 180:
            assert new_for == "3m"
        else:
            assert new_for == old_for  # 2m stays 2m: shortening never lengthens
        assert new == old
    path = tmp_path / "rules.yml"
    path.write_text(generated)
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_config_points_at_the_stack_and_passes_promtool(tmp_path: Path) -> None:
    (tmp_path / "llmgw-alerts.yml").write_text(prom.rules_with_for(prom.SHIPPED_RULES.read_text(), "10s"))
    config = tmp_path / "prometheus.yml"
    config.write_text(prom.dev_config(prom.SHIPPED_CONFIG.read_text(), consul_addr="http://127.0.0.1:18500"))
    doc = yaml.safe_load(config.read_text())
    # Beside the configuration, as in the shipped one: Prometheus's alert page names the rule
    # file as written here, and the demo's should not show a temporary directory.
    assert doc["rule_files"] == ["llmgw-alerts.yml"]
    assert doc["scrape_configs"][0]["consul_sd_configs"][0]["server"] == "127.0.0.1:18500"
    assert doc["global"]["evaluation_interval"] == prom.DEV_INTERVAL
    result = check_config(config)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("5m", 300), ("1h30m", 5400), ("500ms", 0.5)])
def test_durations_read_as_prometheus_reads_them(text: str, seconds: float) -> None:
    assert prom.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "5 m", "1.5m", "ten minutes"])
def test_a_bad_duration_is_refused_with_what_to_write(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a Prometheus duration.*30s, 5m"):
        prom.parse_duration(text)


def test_a_file_that_is_not_a_rule_file_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^mine\.yml: not a Prometheus rule file"):
        prom.rules_with_for("scrape_configs: []\n", "10s", source="mine.yml")


def scraped_jobs(prometheus_url: str) -> dict[str, int]:
    """How many targets of each job Prometheus scrapes with success."""
    targets = httpx.get(f"{prometheus_url}/api/v1/targets", params={"state": "active"}, timeout=10).json()
    up: dict[str, int] = {}
    for target in targets["data"]["activeTargets"]:
        if target["health"] == "up":
            up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
    return up


@pytest.mark.slow
def test_in_process_mode_prometheus_still_finds_the_watchers_and_the_router_in_consul(
    start_standin: Callable[..., StandIn], consul_url: str, tmp_path: Path
) -> None:
    # `devstack up --services process` runs no jobs, so nobody but the dev stack itself can put
    # the services in Consul; without them Prometheus would scrape nothing and no alert fire.
    standin = start_standin()
    started = services.start_as_processes(
        nomad_url=standin.url,
        consul_url=consul_url,
        venv=services.venv_root(),
        watchers=2,
        max_start_failures=5,
        router_port=free_port(),
        logs_dir=tmp_path / "logs",
        say=print,
    )
    server = None
    try:
        server = prom.start(
            state_dir=tmp_path / "prometheus", consul_url=consul_url, log=tmp_path / "prom.log"
        )
        deadline = time.monotonic() + 60
        while scraped_jobs(server.url) != {"llmgw-watcher": 2, "llmgw-router": 1}:
            assert time.monotonic() < deadline, (
                f"Prometheus scrapes {scraped_jobs(server.url)}; see {server.log}"
            )
            time.sleep(1)
        catalog = httpx.get(f"{consul_url}/v1/catalog/service/llmgw-watcher", timeout=10).json()
        assert {entry["ServicePort"] for entry in catalog} == {
            int(url.rsplit(":", 1)[1]) for url in started.watcher_urls
        }
    finally:
        if server is not None:
            processes.stop_group(server.process.pid)
        for child in started.children:
            processes.stop_group(child.pid)
