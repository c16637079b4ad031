"""Where operators look, on the dev stack as a user runs it: a real Prometheus that found llmgw
in Consul, with the shipped alert rules, and Consul's own web UI in a real browser.

1. Every PromQL expression of the alert rules and of the Grafana dashboard runs against that
   Prometheus without error, every series it selects exists (whatever its name), and every
   label it matches, groups or joins by is on those series, so a renamed metric or label
   cannot silently blind a panel or an alert (tests/e2e/promql.py reads the expressions).
2. The Consul UI, in headless chromium, shows each model with its check: kev-0.5b critical with
   why it was parked, phi-4 critical with why it fits nowhere, Gemma passing.
3. The alerts fire in Prometheus (rules generated from the shipped file with `for:` cut short)
   for the parked, the unplaceable and the nothing-ready model (and fired for kev-0.5b while it
   was placed and failing, before it was parked), and resolve once each model is fixed: kev-0.5b
   by new weights and `llmgw ctl retry`, phi-4 by a profile that fits, applied.

One stack for the module; the tests run in file order and the last one changes it (both models
are fixed). Screenshots are saved in the stack's directory, beside its `up.out` and `logs/`:
`<pytest's basetemp>/where-operators-look0/screenshots/`, taken whether or not the page loaded;
every assertion about a page names its picture.
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
from tests.e2e import promql
from tests.e2e.browser import (
    browser_page,
    model_checks_page,
    prometheus_alerts_page,
    service_instances_page,
    shooting,
)
from tests.e2e.conftest import UP_TIMEOUT_S, DevStack, start_devstack, wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "jobs" / "grafana" / "llmgw-dashboard.json"
KEV = "kev-0.5b"
PHI = "phi-4"
GEMMA = "gemma-3-270m"
ON_DEMAND = "gemma-3-270m-on-demand"
SPLIT = "gemma-3-270m-split"
MODELS = (GEMMA, ON_DEMAND, SPLIT, KEV, PHI)
ARCH_ERROR = "unknown model architecture: 'kev'"
ALERT_FOR = "10s"
STACK_DIR = "where-operators-look"
# What Grafana puts in for its variables: every demo model (so a renamed `model` label matches
# nothing), and a rate window of a few scrapes.
GRAFANA_VARS = {"$model": "|".join(MODELS), "$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}
# pytest-timeout counts the module's stack start (in the first test's setup) and its stop (in
# the last test's teardown) with the test, and any test may be first or last (-k): each test
# gets both on top of its own waits, so that a slow machine fails on the wait that ran out,
# named, rather than on pytest-timeout's 300 s. DevStack.down: `devstack down` 180 s, then 40.
STACK_START_AND_STOP_S = UP_TIMEOUT_S + 220


def within(waits_s: float) -> pytest.MarkDecorator:
    """The timeout for a test whose own waits add up to `waits_s`, with a minute for its calls."""
    return pytest.mark.timeout(STACK_START_AND_STOP_S + waits_s + 60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    # Named for this module, so that after a run its logs and screenshots are at a path CI can
    # collect: <basetemp>/where-operators-look0/ (pytest-of-$USER/pytest-current/ by default).
    started = start_devstack(tmp_path_factory.mktemp(STACK_DIR), "--alert-for", ALERT_FOR)
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


def screenshot(stack: DevStack, name: str) -> Path:
    return stack.state_dir / "screenshots" / name


def seen(path: Path, what: object) -> str:
    """An assertion message about a page: what was read, and where its picture is."""
    return f"{what}\n    screenshot: {path}"


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


def unseen(stack: DevStack, expr: str) -> list[str]:
    """What `expr` asks of the series that none Prometheus scraped from the stack has: a
    selector matching nothing, or a label that it matches, groups or joins by and that no
    series it selects carries (a renamed label collapses a panel into one line, or none)."""
    reading = promql.read(expr)
    series: dict[str, list[dict[str, str]]] = {}
    problems: list[str] = []
    for selector in reading.selectors:
        if selector.text in series:
            continue
        found = series[selector.text] = api(stack, "series", **{"match[]": selector.text})
        if not found:
            problems.append(f"{selector.text}: no such series")
        for label in selector.labels:
            if found and not any(label in s for s in found):
                problems.append(f"{selector.text}: no series has the label {label!r}")
    for grouping in reading.groupings:
        scope = [s for selector in grouping.selectors for s in series[selector.text]]
        if not scope:
            continue  # its selectors are reported missing above
        carried = set(grouping.made).union(*(s.keys() for s in scope))
        names = ", ".join(dict.fromkeys(s.text for s in grouping.selectors))
        problems += [
            f"{grouping.clause}: no series of {names} has the label {label!r}"
            for label in grouping.labels
            if label not in carried
        ]
    return problems


def traffic(stack: DevStack) -> None:
    """What the router panels count: answers, an activation, refusals of both kinds."""
    client = openai.OpenAI(base_url=f"{stack.router}/v1", api_key="e2e", max_retries=0, timeout=180)
    assert client.completions.create(model=GEMMA, prompt="Hello", max_tokens=4).choices
    assert client.completions.create(model=ON_DEMAND, prompt="Hello", max_tokens=4).choices
    for model in (KEV, PHI):
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model=model, prompt="Hello", max_tokens=4)


# ----- 1. every query is real ---------------------------------------------------------------------


@within(90)
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


# Four requests of up to 180 s each (one activates a replica), the wait for the counters, the queries.
@within(4 * 180 + 60 + 120)
def test_every_alert_and_dashboard_query_runs_and_names_only_series_that_exist(stack: DevStack) -> None:
    traffic(stack)
    queries = rule_queries() + dashboard_queries()
    assert len(queries) >= 30, f"fewer queries than the rules and dashboard hold: {len(queries)}"
    # The router's counters appear at its next scrape after the requests above: all of them,
    # not only the refusals (a series that already existed at 0 says nothing of that scrape).
    wait_until(
        "the router's counters scraped",
        lambda: not any(unseen(stack, expr) for where, expr in queries if "llmgw_router_" in expr),
        timeout=60,
    )
    failures = []
    for where, expr in queries:
        resp = httpx.get(f"{prometheus(stack)}/api/v1/query", params={"query": expr}, timeout=30)
        body = resp.json()
        if body.get("status") != "success":
            failures.append(f"{where}: {expr}\n    error: {body.get('errorType')}: {body.get('error')}")
            continue
        failures += [f"{where}: {expr}\n    {problem}" for problem in unseen(stack, expr)]
    assert not failures, "queries that would show nothing, or one line for many:\n" + "\n".join(failures)

    # The dashboard's model variable lists every defined model.
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()  # type: ignore[union-attr]
    assert set(api(stack, f"label/{label}/values", **{"match[]": metric})) == set(MODELS)

    # Prometheus evaluates every shipped rule without error.
    rules = [r for g in api(stack, "rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {q[0].removeprefix("alert ") for q in rule_queries()}
    assert [r["name"] for r in rules if r["health"] != "ok"] == [], rules


@within(30)
def test_a_renamed_metric_or_label_would_be_caught(stack: DevStack) -> None:
    # The check above must be able to fail, on every kind of rename. What it passes, first:
    engines = "max by (model, engine, version) (llmgw_model_engine_available) == 0"
    assert unseen(stack, engines) == []
    assert unseen(stack, "sum by (job) (up)") == []  # Prometheus's own, not llmgw's
    # A metric nobody publishes, llmgw's or not.
    assert unseen(stack, "max by (model) (llmgw_model_parkd)") == ["llmgw_model_parkd: no such series"]
    assert unseen(stack, "sum by (job) (upp) or vector(0)") == ["upp: no such series"]
    # A label renamed in a matcher: one that selects nothing, and one that no longer filters.
    assert unseen(stack, 'sum(llmgw_model_parked{modell=~"phi-4"})') == [
        'llmgw_model_parked{modell=~"phi-4"}: no such series'
    ]
    assert unseen(stack, 'llmgw_engine_installs{engin!="vllm"}') == [
        "llmgw_engine_installs{engin!=\"vllm\"}: no series has the label 'engin'"
    ]
    # A label renamed in a grouping: the panel would draw one line where it drew one per version.
    assert unseen(stack, engines.replace("version)", "versoin)")) == [
        "by (model, engine, versoin): no series of llmgw_model_engine_available has the label 'versoin'"
    ]
    assert unseen(stack, "sum(llmgw_engine_installs) without (engin)") == [
        "without (engin): no series of llmgw_engine_installs has the label 'engin'"
    ]
    joined = "llmgw_model_parked * on (model) group_left (engin) llmgw_model_engine_available"
    assert unseen(stack, joined) == [
        "group_left (engin): no series of llmgw_model_parked, llmgw_model_engine_available "
        "has the label 'engin'"
    ]


# ----- 2. the Consul UI -----------------------------------------------------------------------------


@within(2 * 60)  # two pages, each allowed LOAD_TIMEOUT_MS
def test_consul_ui_shows_each_model_with_its_check_and_why(stack: DevStack) -> None:
    phi_reason = str(admin_model(stack, PHI).get("placement_reason") or "")
    assert phi_reason, admin_model(stack, PHI)
    with browser_page() as page:
        with shooting(page, screenshot(stack, "consul-ui-instances.png")) as instances_shot:
            instances = service_instances_page(page, stack.consul)
        with shooting(page, screenshot(stack, "consul-ui-models.png")) as shot:
            cards = model_checks_page(page, stack.consul)
    print(f"screenshots: {instances_shot}, {shot}")
    for model in MODELS:
        assert f"llmgw-model-{model}" in instances, seen(instances_shot, instances)
    assert set(cards) == set(MODELS), seen(shot, cards)
    assert cards[KEV].status == "critical", seen(shot, cards[KEV])
    assert "parked" in cards[KEV].output and ARCH_ERROR in cards[KEV].output, seen(shot, cards[KEV])
    assert cards[PHI].status == "critical", seen(shot, cards[PHI])
    assert phi_reason in cards[PHI].output, seen(shot, (phi_reason, cards[PHI]))
    assert cards[GEMMA].status == "passing", seen(shot, cards[GEMMA])
    assert cards[SPLIT].status == "passing", seen(shot, cards[SPLIT])
    # The on-demand copy is stopped by design, not failing.
    assert cards[ON_DEMAND].status != "critical", seen(shot, cards[ON_DEMAND])


@within(60)
def test_a_page_that_does_not_load_still_leaves_its_picture(stack: DevStack) -> None:
    # A node that is not there: the checks never draw, and the test that waited for them must
    # say where the picture of what the browser showed instead is.
    path = screenshot(stack, "consul-ui-missing-node.png")
    with browser_page() as page, pytest.raises(AssertionError, match=f"screenshot: {re.escape(str(path))}"):
        page.set_default_timeout(3000)
        with shooting(page, path):
            model_checks_page(page, stack.consul, node="no-such-node")
    assert path.stat().st_size > 0


# ----- 3. the alerts fire, and resolve --------------------------------------------------------------


def alerts_by_model(stack: DevStack, state: str = "firing") -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for alert in prom.alerts(prometheus(stack)):
        if alert.get("state") == state:
            found.setdefault(alert["labels"].get("model", ""), set()).add(alert["labels"]["alertname"])
    return found


@within(30)
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
    groups = api(stack, "rules")["groups"]
    durations = {r["name"]: r["duration"] for g in groups for r in g["rules"]}
    assert durations["LlmgwModelNothingReady"] == limit and durations["LlmgwModelParked"] == 0
    # The alert page heads each group with its file, as an operator's reads: no temporary path.
    assert {g["file"] for g in groups} == {prom.RULES_FILE}


def demo_alerts_firing(stack: DevStack) -> None:
    wait_until(
        "the demo's alerts firing in Prometheus",
        lambda: set(prom.DEMO_ALERTS) <= prom.firing(prometheus(stack)),
        timeout=120,
        interval=2,
    )


def ever(stack: DevStack, expr: str) -> list[dict[str, Any]]:
    """The series of `expr` at any moment since the stack started (Prometheus keeps them all)."""
    result: list[dict[str, Any]] = api(stack, "query", query=f"max_over_time(({expr})[1h:5s])")["result"]
    return result


@within(120 + 60)
def test_parked_unplaceable_and_nothing_ready_alerts_fire(stack: DevStack) -> None:
    demo_alerts_firing(stack)
    firing = alerts_by_model(stack)
    assert "LlmgwModelParked" in firing[KEV]
    assert {"LlmgwModelUnplaceable", "LlmgwModelNothingReady"} <= firing[PHI]
    # A parked model is no longer meant to run (its desired replicas read 0), so it pages once,
    # as parked, and its five failed starts are no longer "climbing" (docs/operating.md, 10).
    assert not {"LlmgwModelNothingReady", "LlmgwModelStartFailuresClimbing"} & firing[KEV], firing[KEV]
    # Nothing cries wolf: the serving models, the idle one and the control plane are quiet.
    pending = alerts_by_model(stack, "pending")
    for quiet in (GEMMA, SPLIT, ON_DEMAND, ""):
        assert quiet not in firing and quiet not in pending, (quiet, firing, pending)
    with browser_page() as page, shooting(page, screenshot(stack, "prometheus-alerts.png")) as shot:
        text = prometheus_alerts_page(page, prometheus(stack), expand=("LlmgwModelParked",))
    assert "LlmgwModelParked" in text and KEV in text, seen(shot, text)
    # What the demo's tour prints, from the same API.
    shown = alerts_step(prometheus(stack), wait_s=0)
    assert f"llmgw model {KEV} is parked" in shown and f"llmgw model {PHI} fits on no node" in shown, shown
    # Nothing ready is not only the unplaceable model's alert: kev-0.5b fired it while it was
    # placed and failing its starts, before it was parked (desired 1, ready 0, never unplaceable).
    fired = ever(stack, f'ALERTS{{alertname="LlmgwModelNothingReady", alertstate="firing", model="{KEV}"}}')
    assert fired, f"{KEV} never fired LlmgwModelNothingReady while it was failing its starts"
    assert ever(stack, f'llmgw_model_unplaceable{{model="{KEV}"}} > 0') == []


def resolved(stack: DevStack, model: str) -> bool:
    return model not in alerts_by_model(stack) and model not in alerts_by_model(stack, "pending")


# The demo's alerts, kev-0.5b serving and its alerts gone, phi-4 serving and its alerts gone,
# the Consul UI.
@within(120 + 180 + 60 + 180 + 60 + 60)
def test_alerts_resolve_once_the_models_are_fixed(stack: DevStack) -> None:
    # What is to resolve has fired first (alone, with -k, this test would otherwise prove nothing).
    demo_alerts_firing(stack)
    assert "LlmgwModelParked" in alerts_by_model(stack)[KEV]

    # kev-0.5b: the operator replaces the broken weights with a model this llama.cpp knows (same
    # path, so the definition is unchanged and only a retry places it again).
    weights = stack.state_dir / "models" / f"{KEV}.gguf"
    fixed = write_tiny_gguf(weights.with_suffix(".fixed"), seed=5, context=2048)
    fixed.replace(weights)
    retry = stack.llmgw("ctl", "retry", KEV)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    wait_until(f"{KEV} serving after the retry", lambda: admin_model(stack, KEV).get("ready"), timeout=180)
    started = time.monotonic()
    wait_until(f"{KEV}'s alerts resolved in Prometheus", lambda: resolved(stack, KEV), timeout=60, interval=2)
    print(f"{KEV}'s alerts resolved {time.monotonic() - started:.0f}s after it was ready")
    # The other incident is untouched, and still says so.
    assert {"LlmgwModelUnplaceable", "LlmgwModelNothingReady"} <= alerts_by_model(stack)[PHI]

    # phi-4: the operator gives it a profile that fits (a new definition, so no retry needed).
    models_file = stack.state_dir / "models.yaml"
    models = yaml.safe_load(models_file.read_text())
    models["models"][PHI]["profile"] = models["models"][GEMMA]["profile"]
    models_file.write_text(yaml.safe_dump(models, sort_keys=False))
    applied = stack.llmgw("apply", "--auto-approve", str(models_file))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    wait_until(
        f"{PHI} serving with a profile that fits", lambda: admin_model(stack, PHI).get("ready"), timeout=180
    )
    started = time.monotonic()
    wait_until(f"{PHI}'s alerts resolved in Prometheus", lambda: resolved(stack, PHI), timeout=60, interval=2)
    print(f"{PHI}'s alerts resolved {time.monotonic() - started:.0f}s after it was ready")
    assert alerts_by_model(stack) == {}, alerts_by_model(stack)

    with browser_page() as page, shooting(page, screenshot(stack, "consul-ui-after-fixes.png")) as shot:
        cards = model_checks_page(page, stack.consul)
    assert cards[KEV].status == "passing", seen(shot, cards[KEV])
    assert cards[PHI].status == "passing", seen(shot, cards[PHI])
