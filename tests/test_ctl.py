"""`llmgw ctl` against a real HTTP server serving admin JSON shaped as docs/admin-api.md says."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from typer.testing import CliRunner, Result

from nomad_driver.cli.app import app
from nomad_driver.summary import fleet_summary

NOW = 1_800_000_000.0


def model(name: str, desired: int, ready: int, state: str, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": name,
        "desired": desired,
        "ready": ready,
        "starting": 0,
        "state": state,
        "reason": "",
        "parked": False,
        "unplaceable": False,
        "consecutive_failures": 0,
        "last_error": "",
        "placement_reason": "",
        "replicas_min": 0,
        "replicas_max": 2,
    }
    row.update(extra)
    return row


QWEN = model("qwen2.5-0.5b", 1, 1, "satisfied", replicas_min=1)
ON_DEMAND = model("gemma-270m", 0, 0, "idle")
KEV = model(
    "kev-0.5b",
    0,
    0,
    "parked",
    parked=True,
    consecutive_failures=5,
    last_error="unknown model architecture: 'kev'",
    reason="parked after 5 consecutive start failures: unknown model architecture: 'kev'",
)
PHI = model(
    "phi-4",
    1,
    0,
    "unplaceable",
    unplaceable=True,
    placement_reason="no node has 2 x nvidia/gpu with >= 80000 MiB; 4 nodes evaluated, 4 exhausted on devices",
    reason="no node has 2 x nvidia/gpu with >= 80000 MiB; 4 nodes evaluated, 4 exhausted on devices",
)
LLAMA = model("llama-3-8b", 2, 1, "short", reason="1 of 2 replicas ready")
STARTING = model("mistral-7b", 1, 0, "starting", starting=1, reason="1 replica starting")


def gpu_node(node_id: str, n: int, unhealthy: int = 0, **fields: Any) -> dict[str, Any]:
    instances = [{"ID": f"{node_id}-{i}", "Healthy": i >= unhealthy} for i in range(n)]
    return {
        "ID": node_id,
        "Status": "ready",
        "SchedulingEligibility": "eligible",
        "DrainStrategy": None,
        "Meta": {"llmgw_gpu_class": "h100", "llmgw_fabric": "ib-a"},
        "NodeResources": {
            "Devices": [{"Vendor": "nvidia", "Type": "gpu", "Name": "H100", "Instances": instances}]
        },
    } | fields


SUMMARY = fleet_summary(
    nodes=[gpu_node("n1", 4, unhealthy=1), gpu_node("n2", 4), gpu_node("n3", 4, Status="down")],
    allocs=[
        {
            "ID": "a1b2c3d4-0000",
            "NodeID": "n1",
            "ClientStatus": "running",
            "AllocatedResources": {"Tasks": {"engine": {"Devices": [{"DeviceIDs": ["n1-1", "n1-2"]}]}}},
        }
    ],
    replicas=[
        {
            "model": "qwen2.5-0.5b",
            "node": "n1",
            "alloc_id": "a1b2c3d4-0000",
            "ready": True,
            "last_request_at": NOW - 5400,
        }
    ],
    models={m["model"]: m for m in (QWEN, KEV, PHI)},
    now=NOW,
)


class AdminServer:
    """Canned admin API on a free loopback port, in its own thread and event loop."""

    def __init__(self) -> None:
        self.models: list[dict[str, Any]] = [QWEN, ON_DEMAND, KEV, PHI, LLAMA]
        self.summary: dict[str, Any] = SUMMARY
        self.extra: dict[str, Any] = {}
        self.replicas: list[dict[str, Any]] = []
        self.token: str | None = None
        self.seen_auth: list[str | None] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def _app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            header = request.headers.get("Authorization")
            self.seen_auth.append(header)
            if self.token and header != f"Bearer {self.token}":
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            response: web.StreamResponse = await handler(request)
            return response

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"models": self.models, **self.extra})

        async def one_model(request: web.Request) -> web.Response:
            name = request.match_info["model"]
            for m in self.models:
                if m["model"] == name:
                    return web.json_response(m)
            return web.json_response({"error": f"unknown model '{name}'"}, status=404)

        async def summary(request: web.Request) -> web.Response:
            return web.json_response(self.summary)

        application = web.Application(middlewares=[auth])
        application.router.add_get("/v1/admin/models", models)
        application.router.add_get("/v1/admin/models/{model}", one_model)
        application.router.add_get("/v1/admin/summary", summary)

        async def replicas(request: web.Request) -> web.Response:
            return web.json_response({"replicas": self.replicas})

        application.router.add_get("/v1/admin/replicas", replicas)
        return application

    def start(self) -> None:
        self._thread.start()
        self._runner = web.AppRunner(self._app())
        asyncio.run_coroutine_threadsafe(self._runner.setup(), self._loop).result(10)
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), self._loop).result(10)
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def admin() -> Iterator[AdminServer]:
    server = AdminServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def ctl(addr: str, *args: str, token: str | None = None) -> Result:
    env = {"LLMGW_ADMIN_ADDR": addr, "COLUMNS": "220", "NO_COLOR": "1"}
    if token is not None:
        env["LLMGW_ADMIN_TOKEN"] = token
    return CliRunner().invoke(app, ["ctl", *args], env=env)


def cells(line: str) -> list[str]:
    """The cells of one rich table row."""
    return [c.strip() for c in line.strip().strip("│").split("│")]


def row_of(out: str, name: str) -> list[str]:
    return cells(next(line for line in out.splitlines() if f"│ {name} " in line))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_status_shows_each_model_against_what_it_should_have_now(admin: AdminServer) -> None:
    result = ctl(admin.url, "status")
    assert result.exit_code == 0, result.output
    out = result.stdout
    kev = row_of(out, "kev-0.5b")
    assert kev[1:4] == ["0", "0", "parked"]
    assert "unknown model architecture: 'kev'" in kev[-1]
    assert row_of(out, "phi-4")[1:4] == ["1", "0", "unplaceable"]
    # In flight and why desired is what it is come before the reason; this fixture has neither.
    assert row_of(out, "llama-3-8b")[1:] == ["2", "1", "short", "0", "", "1 of 2 replicas ready"]
    assert row_of(out, "qwen2.5-0.5b")[1:4] == ["1", "1", "satisfied"]
    # What needs a person first.
    assert (
        out.index("│ kev-0.5b")
        < out.index("│ phi-4")
        < out.index("│ llama-3-8b")
        < out.index("│ qwen2.5-0.5b")
    )


def test_status_json_prints_the_admin_api_models(admin: AdminServer) -> None:
    result = ctl(admin.url, "status", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"models": admin.models}


def test_status_of_named_models_asks_for_each(admin: AdminServer) -> None:
    result = ctl(admin.url, "status", "--json", "phi-4", "qwen2.5-0.5b")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"models": [PHI, QWEN]}


@pytest.mark.parametrize(
    ("problem", "expected"),
    [(KEV, "kev-0.5b (parked)"), (PHI, "phi-4 (unplaceable)"), (LLAMA, "llama-3-8b (short)")],
)
def test_status_check_exits_1_when_a_model_is_not_serving(
    admin: AdminServer, problem: dict[str, Any], expected: str
) -> None:
    admin.models = [QWEN, ON_DEMAND, problem]
    result = ctl(admin.url, "status", "--check")
    assert result.exit_code == 1, result.output
    assert expected in result.stderr
    assert "1 of 3 models not serving" in result.stderr


def test_status_check_counts_an_on_demand_model_asked_for_and_not_ready_as_short(admin: AdminServer) -> None:
    # Whatever word the watcher used, ready below desired is short: that is the bug that hid phi-4.
    admin.models = [QWEN, model("gemma-270m", 1, 0, "satisfied")]
    result = ctl(admin.url, "status", "--check", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["models"][1]["model"] == "gemma-270m"
    assert "gemma-270m (short)" in result.stderr
    assert row_of(ctl(admin.url, "status").stdout, "gemma-270m")[1:4] == ["1", "0", "short"]


def test_status_check_exits_0_when_every_model_has_what_it_should(admin: AdminServer) -> None:
    admin.models = [QWEN, ON_DEMAND]
    result = ctl(admin.url, "status", "--check")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_unknown_model_exits_4(admin: AdminServer) -> None:
    for verb in ("status", "models"):
        result = ctl(admin.url, verb, "no-such-model")
        assert result.exit_code == 4, result.output
        assert "unknown model 'no-such-model'" in result.stderr


def test_unreachable_admin_api_exits_3_and_says_what_to_do() -> None:
    addr = f"http://127.0.0.1:{free_port()}"
    for verb in ("status", "models", "summary"):
        result = ctl(addr, verb)
        assert result.exit_code == 3, result.output
        assert result.stderr.startswith(f"cannot reach the llmgw admin API at {addr}: ")
        assert result.stderr.strip().endswith("is `llmgw watcher` running? set LLMGW_ADMIN_ADDR")
        assert result.stdout == ""


def test_token_is_sent_as_bearer_and_a_refusal_exits_5(admin: AdminServer) -> None:
    admin.token = "s3cret"
    assert ctl(admin.url, "status", token="s3cret").exit_code == 0
    assert admin.seen_auth[-1] == "Bearer s3cret"

    result = ctl(admin.url, "status", token="wrong")
    assert result.exit_code == 5
    assert "401: missing or wrong bearer token; check LLMGW_ADMIN_TOKEN" in result.stderr


def test_models_table_lists_bounds_failures_and_last_error(admin: AdminServer) -> None:
    result = ctl(admin.url, "models")
    assert result.exit_code == 0, result.output
    assert row_of(result.stdout, "kev-0.5b") == [
        "kev-0.5b", "0..2", "0", "0", "0", "5", "parked", "unknown model architecture: 'kev'"
    ]  # fmt: skip
    assert row_of(result.stdout, "qwen2.5-0.5b")[1] == "1..2"


def test_models_reads_nested_replica_bounds_too(admin: AdminServer) -> None:
    nested = {k: v for k, v in QWEN.items() if not k.startswith("replicas_")} | {
        "replicas": {"min": 2, "max": 4}
    }
    admin.models = [nested]
    assert row_of(ctl(admin.url, "models").stdout, "qwen2.5-0.5b")[1] == "2..4"


def test_status_says_when_the_definitions_did_not_load(admin: AdminServer) -> None:
    admin.extra = {
        "definitions_problem": "models.kev-0.5b.profile: unknown profile 'gpu9'",
        "is_leader": True,
    }
    result = ctl(admin.url, "status")
    assert result.exit_code == 0, result.output
    assert "model definitions not loaded: models.kev-0.5b.profile: unknown profile 'gpu9'" in result.stderr
    as_json = json.loads(ctl(admin.url, "status", "--json").stdout)
    assert as_json["is_leader"] is True and as_json["models"] == admin.models


def test_models_json_for_all_and_for_one(admin: AdminServer) -> None:
    everything = ctl(admin.url, "models", "--json")
    assert everything.exit_code == 0, everything.output
    assert json.loads(everything.stdout) == {"models": admin.models}
    one = ctl(admin.url, "models", "phi-4", "--json")
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout) == PHI
    table = ctl(admin.url, "models", "phi-4")
    assert "4 nodes evaluated, 4 exhausted on devices" in table.stdout


def test_summary_puts_parked_and_unplaceable_before_gpu_use(admin: AdminServer) -> None:
    result = ctl(admin.url, "summary")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("PARKED") < out.index("UNPLACEABLE") < out.index("GPUs per class")
    assert "unknown model architecture: 'kev'" in out
    h100 = row_of(out, "h100")
    # 12 cards: 2 used, 1 unhealthy, 4 on the down node, 5 free; the bar in proportion (30 cells).
    assert h100[2:] == ["2", "5", "1", "4", "12"]
    assert h100[1] == "█" * 5 + "█" * 2 + "▒" * 10 + "░" * 13
    assert "nodes: 3 total, 2 ready, 0 draining, 0 ineligible, 1 down" in out
    assert "models: 3 total, 1 satisfied, 2 short (kev-0.5b parked, phi-4 0 of 1 ready)" in out
    assert row_of(out, "qwen2.5-0.5b") == ["qwen2.5-0.5b", "n1", "a1b2c3d4", "1h30m", "2"]


def test_summary_json_is_the_admin_api_summary(admin: AdminServer) -> None:
    result = ctl(admin.url, "summary", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == SUMMARY


def test_quiet_fleet_says_nothing_is_parked(admin: AdminServer) -> None:
    admin.summary = fleet_summary([gpu_node("n1", 2)], [], [], {"qwen2.5-0.5b": QWEN}, NOW)
    result = ctl(admin.url, "summary")
    assert result.exit_code == 0, result.output
    assert "no parked or unplaceable models" in result.stdout
    assert "PARKED" not in result.stdout


SPLIT = model(
    "gemma-split",
    1,
    1,
    "satisfied",
    nodes=2,
    fabric="ib-a",
    replica_nodes=["ib-a-0", "ib-a-1"],
    shards_running=1,
)


def test_status_shows_a_multi_node_models_shards_and_fabric(admin: AdminServer) -> None:
    admin.models = [QWEN, SPLIT]
    out = ctl(admin.url, "status").stdout
    header = next(line for line in out.splitlines() if "MODEL" in line)
    assert [c.strip() for c in header.strip().strip("┃").split("┃")][:5] == [
        "MODEL",
        "DESIRED",
        "READY",
        "SHARDS",
        "FABRIC",
    ]
    assert row_of(out, "gemma-split")[1:6] == ["1", "1", "1/1", "ib-a", "satisfied"]
    assert row_of(out, "qwen2.5-0.5b")[3:5] == ["", ""]
    # Without a multi-node model the table is as it always was.
    admin.models = [QWEN]
    assert "SHARDS" not in ctl(admin.url, "status").stdout
    admin.models = [QWEN, SPLIT]
    as_json = json.loads(ctl(admin.url, "status", "--json").stdout)
    split = next(m for m in as_json["models"] if m["model"] == "gemma-split")
    assert (split["fabric"], split["replica_nodes"], split["shards_running"]) == (
        "ib-a",
        ["ib-a-0", "ib-a-1"],
        1,
    )


def test_replicas_lists_a_multi_node_replica_once_with_its_shards(admin: AdminServer) -> None:
    shard = {"alloc_id": "b" * 36, "node": "ib-a-1", "node_id": "n2", "fabric": "ib-a", "state": "running"}
    admin.replicas = [
        {
            "model": "gemma-split",
            "alloc_id": "a" * 36,
            "node": "ib-a-0",
            "node_id": "n1",
            "address": "10.0.0.1:20000",
            "state": "ready",
            "ready": True,
            "since": NOW,
            "fabric": "ib-a",
            "shards": [shard],
        }
    ]
    result = ctl(admin.url, "replicas")
    assert result.exit_code == 0, result.output
    assert row_of(result.stdout, "gemma-split")[:6] == [
        "gemma-split",
        "aaaaaaaa",
        "ib-a-0",
        "ib-a",
        "ib-a-1 running",
        "10.0.0.1:20000",
    ]
    assert json.loads(ctl(admin.url, "replicas", "--json").stdout)["replicas"][0]["shards"] == [shard]
