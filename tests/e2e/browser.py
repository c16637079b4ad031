"""What an operator sees, read from a real browser: Debian's chromium driven by Playwright.

Playwright is launched with the chromium `make setup` unpacks (devstack/fetch-chromium.sh) as
its executable; `playwright install`, which downloads a browser of its own, is never run.

Run as a program against a running dev stack it takes the screenshots in docs/:

    python -m tests.e2e.browser docs/      # reads .devstack/env (or --env FILE)
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Page, ViewportSize, sync_playwright

CACHED_CHROMIUM = Path.home() / ".cache" / "llmgw" / "chromium" / "chromium"
MODELS_NODE = "llmgw-models"  # the external catalog node the watcher registers models on
VIEWPORT: ViewportSize = {"width": 1280, "height": 900}
LOAD_TIMEOUT_MS = 60_000


def find_chromium() -> str:
    """`LLMGW_CHROMIUM_BIN`, else the cached unpack from `make setup`, else the system's."""
    from_env = os.environ.get("LLMGW_CHROMIUM_BIN")
    if from_env:
        if not os.access(from_env, os.X_OK):
            raise FileNotFoundError(f"LLMGW_CHROMIUM_BIN={from_env} is not executable; run 'make setup'")
        return from_env
    for candidate in (str(CACHED_CHROMIUM), "/usr/bin/chromium"):
        if os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("chromium")
    if on_path:
        return on_path
    raise FileNotFoundError(
        f"no chromium: LLMGW_CHROMIUM_BIN is unset and neither {CACHED_CHROMIUM} nor /usr/bin/chromium "
        "exists; run 'make setup' (it unpacks Debian's chromium into the cache)"
    )


@contextmanager
def browser_page() -> Iterator[Page]:
    with sync_playwright() as p:
        # --no-sandbox: the tests run as root, where chromium's sandbox refuses to start.
        browser = p.chromium.launch(
            executable_path=find_chromium(), args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(LOAD_TIMEOUT_MS)
            yield page
        finally:
            browser.close()


@dataclass(frozen=True)
class CheckCard:
    """One health check as the Consul UI draws it."""

    title: str  # "model kev-0.5b"
    status: str  # passing | warning | critical, the colour of the card
    output: str


def model_checks_page(page: Page, consul: str, node: str = MODELS_NODE) -> dict[str, CheckCard]:
    """The node page of the models' entries: each model's check with its colour and output."""
    page.goto(f"{consul}/ui/dc1/nodes/{node}/health-checks")
    page.wait_for_selector("li.healthcheck-output h3")
    cards: dict[str, CheckCard] = {}
    for item in page.query_selector_all("li.healthcheck-output"):
        heading = item.query_selector("h3")
        output = item.query_selector('dl:has(dt:text-is("Output")) dd')
        title = heading.inner_text().strip() if heading else ""
        classes = (item.get_attribute("class") or "").split()
        status = next((c for c in classes if c in ("passing", "warning", "critical")), "")
        cards[title.removeprefix("model ").strip()] = CheckCard(
            title, status, output.inner_text().strip() if output else ""
        )
    return cards


def service_instances_page(page: Page, consul: str, service: str = "llmgw-model") -> str:
    """The text of the service's instance list: each instance with its checks' summary."""
    page.goto(f"{consul}/ui/dc1/services/{service}/instances")
    page.wait_for_selector(f"text={service}-")
    # The list is drawn in chunks; its text is complete once the last instance is there.
    page.wait_for_timeout(500)
    return page.inner_text("main")


def prometheus_alerts_page(
    page: Page, prometheus: str, expand: tuple[str, ...] = (), hide_inactive: bool = False
) -> str:
    """Prometheus's alert page (the classic UI of Debian's package), with `expand` opened."""
    page.goto(f"{prometheus}/classic/alerts")
    page.wait_for_selector("text=Firing")
    if hide_inactive:
        page.click("label:has(#inactiveAlerts)")
    for alert in expand:
        page.click(f"text={alert}")
    page.wait_for_timeout(300)
    return page.inner_text("body")


def shoot(page: Page, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path


@contextmanager
def shooting(page: Page, path: Path) -> Iterator[Path]:
    """A screenshot of `page` at `path` when the block ends, however it ends: the page that did
    not load, or loaded wrong, is the picture a failing test most needs. A browser error in the
    block is raised as an AssertionError that names the picture."""
    try:
        yield path
    except PlaywrightError as exc:
        raise AssertionError(f"{exc.message}\n    screenshot: {path}") from exc
    finally:
        try:
            shoot(page, path)
        except PlaywrightError as exc:
            path.with_suffix(".txt").write_text(f"no screenshot of {page.url}: {exc.message}\n")


def _read_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line.removeprefix("export ").partition("=")
            words = shlex.split(value)
            env[key] = words[0] if words else ""
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.browser", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for the PNG files (docs/ for the docs)")
    parser.add_argument(
        "--env", type=Path, default=Path(".devstack/env"), help="the running stack's env file"
    )
    args = parser.parse_args(argv)
    env = _read_env(args.env)
    with browser_page() as page:
        model_checks_page(page, env["CONSUL_HTTP_ADDR"])
        print(shoot(page, args.out / "consul-ui-models.png"))
        prometheus_alerts_page(
            page,
            env["PROMETHEUS_ADDR"],
            expand=("LlmgwModelParked", "LlmgwModelUnplaceable"),
            hide_inactive=True,
        )
        print(shoot(page, args.out / "prometheus-alerts.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
