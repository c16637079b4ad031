"""Where operators look, on the dev stack as a user runs it: a real Prometheus that found llmgw
in Consul, with the shipped alert rules, and Consul's own web UI in a real browser.

1. Every PromQL expression of the alert rules and of the Grafana dashboard runs against that
   Prometheus without error, and every series it names exists, so a renamed metric or label
   cannot silently blind a panel or an alert.
2. The Consul UI, in headless chromium, shows each model with its check: kev-0.5b critical with
   why it was parked, phi-4 critical with why it fits nowhere, Gemma passing.
3. The alerts fire in Prometheus (rules generated from the shipped file with `for:` cut short)
   for the parked, the unplaceable and the nothing-ready model, and resolve once the broken
   model is fixed and `llmgw ctl retry` run.

One stack for the module; the tests run in file order and the last one changes it (kev-0.5b is
fixed). Screenshots are saved in the stack's directory, next to its output and logs.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from devstack import prometheus as prom
from devstack.gguf_tiny import write_tiny_gguf
from devstack.tour import alerts_step
from tests.e2e.browser import (
    browser_page,
    model_checks_page,
    prometheus_alerts_page,
    service_instances_page,
    shoot,
)
from tests.e2e.conftest import DevStack, start_devstack, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "jobs" / "grafana" / "llmgw-dashboard.json"
KEV = "kev-0.5b"
PHI = "phi-4"
GEMMA = "gemma-3-270m"
ON_DEMAND = "gemma-3-270m-on-demand"
MODELS = (GEMMA, ON_DEMAND, KEV, PHI)
ARCH_ERROR = "unknown model architecture: 'kev'"
ALERT_FOR = "10s"
# A selector as PromQL writes it: a metric name and, maybe, its label matchers.
SELECTOR = re.compile(r"\b(llmgw_[a-z0-9_]+)\s*(\{[^}]*\})?")
# What Grafana puts in for its variables: every demo model (so a renamed `model` label matches
# nothing), and a rate window of a few scrapes.
GRAFANA_VARS = {"$model": "|".join(MODELS), "$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    started = start_devstack(tmp_path_factory.mktemp("devstack"), "--alert-for", ALERT_FOR)
    try:
        yield started
    finally:
        started.down()


def prometheus(stack: DevStack) -> str:
    return stack.env["PROMETHEUS_ADDR"]


def api(stack: DevStack, path: str, **params: Any) -> Any:
    resp = httpx.get(f"{prometheus(stack)}/api/v1/{path}", params=params, timeout=30)
    body = resp.json()
    assert body.get("status") == "success", f"{path} {params}: {resp.status_code} {body}"
    return body["data"]


def admin_model(stack: DevStack, model: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{stack.admin}/v1/admin/models/{model}", timeout=10).json()
    return body


def screenshots(stack: DevStack) -> Path:
    return stack.state_dir / "screenshots"


# ----- what is asked of Prometheus --------------------------------------------------------------


def rule_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(prom.SHIPPED_RULES.read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"] if "alert" in r]


def panels(nodes: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in nodes:
        yield panel
        yield from panels(panel.get("panels") or [])


def grafana(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                found.append(
                    (f"panel {panel.get('title')!r} ({target.get('refId')})", grafana(target["expr"]))
                )
    return found


def missing_series(stack: DevStack, expr: str) -> list[str]:
    """The selectors in `expr` that match no series Prometheus has scraped from the stack."""
    missing = []
    for name, matchers in SELECTOR.findall(expr):
        selector = name + (matchers or "")
        if not api(stack, "series", **{"match[]": selector}):
            missing.append(selector)
    return missing


def traffic(stack: DevStack) -> None:
    """What the router panels count: answers, an activation, refusals of both kinds."""
    client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="e2e", max_retries=0, timeout=180)
    assert client.completions.create(model=GEMMA, prompt="Hello", max_tokens=4).choices
    assert client.completions.create(model=ON_DEMAND, prompt="Hello", max_tokens=4).choices
    for model in (KEV, PHI):
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model=model, prompt="Hello", max_tokens=4)


# ----- 1. every query is real ---------------------------------------------------------------------


def test_prometheus_found_the_watchers_and_the_router_in_consul(stack: DevStack) -> None:
    assert stack.env.get("PROMETHEUS_ADDR"), "PROMETHEUS_ADDR is not in the stack's environment"
    env_file = (stack.state_dir / "env").read_text()
    assert f"export PROMETHEUS_ADDR={prometheus(stack)}" in env_file

    def scraped() -> dict[str, int] | None:
        targets = api(stack, "targets", state="active")["activeTargets"]
        up: dict[str, int] = {}
        for t in targets:
            if t["health"] == "up":
                up[t["labels"]["job"]] = up.get(t["labels"]["job"], 0) + 1
        return up if up.get("llmgw-watcher") == 2 and up.get("llmgw-router") == 1 else None

    wait_until("two watchers and a router scraped, found through Consul", scraped, timeout=90)
    targets = api(stack, "targets", state="active")["activeTargets"]
    assert {t["discoveredLabels"]["__meta_consul_service"] for t in targets} == {
        "llmgw-watcher",
        "llmgw-router",
    }
    assert all("metrics" in t["discoveredLabels"]["__meta_consul_tags"] for t in targets)


def test_every_alert_and_dashboard_query_runs_and_names_only_series_that_exist(stack: DevStack) -> None:
    traffic(stack)
    queries = rule_queries() + dashboard_queries()
    assert len(queries) >= 30, f"fewer queries than the rules and dashboard hold: {len(queries)}"
    # The router's counters appear at its next scrape after the requests above.
    wait_until(
        "the router's counters scraped",
        lambda: not missing_series(stack, 'llmgw_router_refusals_total{reason="unplaceable"}'),
        timeout=60,
    )
    failures = []
    for where, expr in queries:
        resp = httpx.get(f"{prometheus(stack)}/api/v1/query", params={"query": expr}, timeout=30)
        body = resp.json()
        if body.get("status") != "success":
            failures.append(f"{where}: {expr}\n    error: {body.get('errorType')}: {body.get('error')}")
            continue
        missing = missing_series(stack, expr)
        if missing:
            failures.append(f"{where}: {expr}\n    no such series: {', '.join(missing)}")
    assert not failures, "queries that would show nothing:\n" + "\n".join(failures)

    # The dashboard's model variable lists every defined model.
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()  # type: ignore[union-attr]
    assert set(api(stack, f"label/{label}/values", **{"match[]": metric})) == set(MODELS)

    # Prometheus evaluates every shipped rule without error.
    rules = [r for g in api(stack, "rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {q[0].removeprefix("alert ") for q in rule_queries()}
    assert [r["name"] for r in rules if r["health"] != "ok"] == [], rules


def test_a_renamed_metric_would_be_caught(stack: DevStack) -> None:
    # The check above must be able to fail: a panel asking for a name nobody publishes.
    assert missing_series(stack, "max by (model) (llmgw_model_parkd)") == ["llmgw_model_parkd"]
    assert missing_series(stack, 'sum(llmgw_router_requests_total{modell=~"phi-4"})') == [
        'llmgw_router_requests_total{modell=~"phi-4"}'
    ]


# ----- 2. the Consul UI -----------------------------------------------------------------------------


def test_consul_ui_shows_each_model_with_its_check_and_why(stack: DevStack) -> None:
    shots = screenshots(stack)
    phi_reason = str(admin_model(stack, PHI).get("placement_reason") or "")
    assert phi_reason, admin_model(stack, PHI)
    with browser_page() as page:
        instances = service_instances_page(page, stack.consul)
        shoot(page, shots / "consul-ui-instances.png")
        for model in MODELS:
            assert f"llmgw-model-{model}" in instances, instances
        cards = model_checks_page(page, stack.consul)
        shoot(page, shots / "consul-ui-models.png")
    print(f"screenshots in {shots}")
    assert set(cards) == set(MODELS), cards
    assert cards[KEV].status == "critical", cards[KEV]
    assert "parked" in cards[KEV].output and ARCH_ERROR in cards[KEV].output, cards[KEV]
    assert cards[PHI].status == "critical", cards[PHI]
    assert phi_reason in cards[PHI].output, (phi_reason, cards[PHI])
    assert cards[GEMMA].status == "passing", cards[GEMMA]
    # The on-demand copy is stopped by design, not failing.
    assert cards[ON_DEMAND].status != "critical", cards[ON_DEMAND]


# ----- 3. the alerts fire, and resolve --------------------------------------------------------------


def alerts_by_model(stack: DevStack, state: str = "firing") -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for alert in prom.alerts(prometheus(stack)):
        if alert.get("state") == state:
            found.setdefault(alert["labels"].get("model", ""), set()).add(alert["labels"]["alertname"])
    return found


def test_dev_stack_rules_are_the_shipped_ones_with_for_cut_short(stack: DevStack) -> None:
    shipped = yaml.safe_load(prom.SHIPPED_RULES.read_text())
    loaded = yaml.safe_load((stack.state_dir / "prometheus" / "llmgw-alerts.yml").read_text())
    limit = prom.parse_duration(ALERT_FOR)
    for group, ours in zip(shipped["groups"], loaded["groups"], strict=True):
        for rule, copy in zip(group["rules"], ours["rules"], strict=True):
            if "for" in rule:
                shipped_for = rule.pop("for")
                expected = ALERT_FOR if prom.parse_duration(shipped_for) > limit else shipped_for
                assert copy.pop("for") == expected, rule["alert"]
            assert copy == rule, rule["alert"]
    durations = {r["name"]: r["duration"] for g in api(stack, "rules")["groups"] for r in g["rules"]}
    assert durations["LlmgwModelNothingReady"] == limit and durations["LlmgwModelParked"] == 0


def test_parked_unplaceable_and_nothing_ready_alerts_fire(stack: DevStack) -> None:
    wait_until(
        "the demo's alerts firing in Prometheus",
        lambda: set(prom.DEMO_ALERTS) <= prom.firing(prometheus(stack)),
        timeout=120,
        interval=2,
    )
    firing = alerts_by_model(stack)
    assert "LlmgwModelParked" in firing[KEV]
    assert {"LlmgwModelUnplaceable", "LlmgwModelNothingReady"} <= firing[PHI]
    # A parked model is no longer meant to run (its desired replicas read 0), so it pages once,
    # as parked, and its five failed starts are no longer "climbing" (docs/operating.md, 10).
    assert not {"LlmgwModelNothingReady", "LlmgwModelStartFailuresClimbing"} & firing[KEV], firing[KEV]
    # Nothing cries wolf: the serving model, the idle one and the control plane are quiet.
    pending = alerts_by_model(stack, "pending")
    for quiet in (GEMMA, ON_DEMAND, ""):
        assert quiet not in firing and quiet not in pending, (quiet, firing, pending)
    with browser_page() as page:
        text = prometheus_alerts_page(page, prometheus(stack), expand=("LlmgwModelParked",))
        shoot(page, screenshots(stack) / "prometheus-alerts.png")
    assert "LlmgwModelParked" in text and KEV in text
    # What the demo's tour prints, from the same API.
    shown = alerts_step(prometheus(stack), wait_s=0)
    assert f"llmgw model {KEV} is parked" in shown and f"llmgw model {PHI} fits on no node" in shown, shown


def test_alerts_resolve_once_the_model_is_fixed_and_retried(stack: DevStack) -> None:
    # The operator replaces the broken weights with a model this llama.cpp knows (same path, so
    # the definition is unchanged and only a retry places it again).
    weights = stack.state_dir / "models" / f"{KEV}.gguf"
    fixed = write_tiny_gguf(weights.with_suffix(".fixed"), seed=5, context=2048)
    fixed.replace(weights)
    retry = stack.llmgw("ctl", "retry", KEV)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    wait_until(f"{KEV} serving after the retry", lambda: admin_model(stack, KEV).get("ready"), timeout=180)
    started = time.monotonic()
    wait_until(
        f"{KEV}'s alerts resolved in Prometheus",
        lambda: KEV not in alerts_by_model(stack) and KEV not in alerts_by_model(stack, "pending"),
        timeout=60,
        interval=2,
    )
    print(f"resolved {time.monotonic() - started:.0f}s after {KEV} was ready")
    # The other incident is untouched, and still says so.
    assert {"LlmgwModelUnplaceable", "LlmgwModelNothingReady"} <= alerts_by_model(stack)[PHI]
    with browser_page() as page:
        cards = model_checks_page(page, stack.consul)
        shoot(page, screenshots(stack) / "consul-ui-after-retry.png")
    assert cards[KEV].status == "passing", cards[KEV]
