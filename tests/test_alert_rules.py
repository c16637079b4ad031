"""The shipped alert rules and dashboard, checked with the real promtool.

The cases themselves (each alert firing when it should and quiet when it should not) live in
jobs/prometheus/llmgw-alerts.test.yml, where operators who change a rule will find them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "jobs" / "prometheus" / "llmgw-alerts.yml"
RULE_TESTS = ROOT / "jobs" / "prometheus" / "llmgw-alerts.test.yml"
DASHBOARD = ROOT / "jobs" / "grafana" / "llmgw-dashboard.json"

# The metric names llmgw publishes (docs/metrics.md). A dashboard or rule that queries any
# other name shows an empty panel or an alert that can never fire.
KNOWN_METRICS = {
    "llmgw_model_desired_replicas",
    "llmgw_model_ready_replicas",
    "llmgw_model_consecutive_start_failures",
    "llmgw_model_parked",
    "llmgw_model_unplaceable",
    "llmgw_model_action_refused",
    "llmgw_model_short",
    "llmgw_model_nomad_gave_up",
    "llmgw_model_degraded",
    "llmgw_model_update_failed",
    "llmgw_model_desired_reason",
    "llmgw_model_in_flight_requests",
    "llmgw_model_engine_available",
    "llmgw_model_fetch_bytes",
    "llmgw_model_fetch_total_bytes",
    "llmgw_model_fetch_rate_bytes",
    "llmgw_engine_installs",
    "llmgw_leader",
    "llmgw_leader_changes_total",
    "llmgw_tls_cert_expiry_timestamp_seconds",
    "llmgw_tls_cert_read_errors_total",
    "llmgw_router_requests_total",
    "llmgw_router_request_duration_seconds",
    "llmgw_router_time_to_first_byte_seconds",
    "llmgw_router_activations_total",
    "llmgw_router_refusals_total",
}
HISTOGRAMS = {"llmgw_router_request_duration_seconds", "llmgw_router_time_to_first_byte_seconds"}
EXPECTED_ALERTS = {
    "LlmgwModelParked",
    "LlmgwModelUnplaceable",
    "LlmgwModelStartFailuresClimbing",
    "LlmgwModelNothingReady",
    "LlmgwModelActionRefused",
    "LlmgwModelShort",
    "LlmgwModelNomadGaveUp",
    "LlmgwModelDegraded",
    "LlmgwModelUpdateFailed",
    "LlmgwEngineVersionMissing",
    "LlmgwNoLeader",
    "LlmgwTLSCertExpiringSoon",
    "LlmgwTLSCertUnreadable",
}
METRIC_RE = re.compile(r"\bllmgw_[a-z0-9_]+")


def promtool() -> str:
    path = os.environ.get("LLMGW_PROMTOOL_BIN") or str(
        Path.home() / ".cache" / "llmgw" / "prometheus" / "usr" / "bin" / "promtool"
    )
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"promtool not found at {path}; run `make setup` (it fetches it) or set LLMGW_PROMTOOL_BIN"
        )
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in METRIC_RE.findall(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
                name = name.removesuffix(suffix)
        names.add(name)
    return names


def dashboard_exprs(node: Any) -> list[str]:
    """Every PromQL string in the dashboard: panel targets and templating queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            # Templating variables keep their query under "query" or "definition".
            if key in ("expr", "query", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(dashboard_exprs(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(dashboard_exprs(item))
    return found


def test_alert_rules_pass_promtool_check() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_rule_cases_pass_promtool_test() -> None:
    result = run_promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_shipped_and_has_firing_and_quiet_cases() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == EXPECTED_ALERTS

    cases = yaml.safe_load(RULE_TESTS.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in cases["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert firing == EXPECTED_ALERTS, f"alerts never shown firing: {EXPECTED_ALERTS - firing}"
    assert quiet == EXPECTED_ALERTS, f"alerts never shown quiet: {EXPECTED_ALERTS - quiet}"


def test_alert_rules_query_only_published_metrics() -> None:
    rules = yaml.safe_load(RULES.read_text())
    used = set().union(*(metric_names(r["expr"]) for g in rules["groups"] for r in g["rules"]))
    assert used <= KNOWN_METRICS, f"unknown metrics in alert rules: {used - KNOWN_METRICS}"


def test_a_broken_rule_file_is_caught(tmp_path: Path) -> None:
    # The check above must be able to fail: promtool rejects a rule with bad PromQL.
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "groups:\n- name: x\n  rules:\n  - alert: X\n    expr: max by (model (llmgw_model_parked)\n"
    )
    assert run_promtool("check", "rules", str(bad)).returncode != 0


def test_dashboard_parses_and_queries_only_published_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 10
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= KNOWN_METRICS, f"unknown metrics in the dashboard: {used - KNOWN_METRICS}"
    # The panels an operator opens it for.
    assert {
        "llmgw_model_parked",
        "llmgw_model_unplaceable",
        "llmgw_model_ready_replicas",
        "llmgw_router_requests_total",
        "llmgw_tls_cert_expiry_timestamp_seconds",
    } <= used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique or Grafana drops panels"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool has no offline expression checker, so each query becomes a recording rule.
    exprs = [e for e in dashboard_exprs(json.loads(DASHBOARD.read_text())) if "label_values" not in e]
    exprs = [e for e in exprs if e != "prometheus"]  # the data source variable's plugin type
    grafana_vars = {"$__rate_interval": "5m", "$model": ".*"}
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
