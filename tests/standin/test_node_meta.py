"""Dynamic node metadata (`/v1/client/metadata`), driven by llmgw's own node agent against the
stand-in: what it publishes lands on the node, wakes blocking queries and makes a model whose
constraint needs an engine version placeable."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from nomad_driver.node_agent.agent import NodeAgent, NodeAgentConfig
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import eval_done, live_allocs, mock_job, tiny_node, wait_for

ENGINE_KEY = "llmgw_engine_llama_cpp_python"


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def node_named(standin: StandIn, name: str) -> dict[str, Any]:
    (stub,) = [n for n in standin.client().nodes.get_nodes() if n["Name"] == name]
    node: dict[str, Any] = standin.client().node.get_node(stub["ID"])
    return node


def no_nvml() -> ModuleType:
    raise ImportError("libnvidia-ml.so.1: cannot open shared object file")


def make_agent(tmp_path: Path, standin: StandIn, node_id: str) -> NodeAgent:
    config = NodeAgentConfig(
        engines_dir=tmp_path / "engines",
        models_dir=tmp_path / "models",
        node_id=node_id,
        nomad_addr=standin.url,
    )
    return NodeAgent(config, nvml_loader=no_nvml)


def install_llama_cpp_python(engines: Path, version: str) -> Path:
    # The whole virtualenv, not bin/python alone: the agent runs the install's interpreter to
    # verify it, and a lone symlinked interpreter would not find the venv's site-packages.
    root = engines / "llama-cpp-python" / version
    root.parent.mkdir(parents=True, exist_ok=True)
    root.symlink_to(sys.prefix, target_is_directory=True)
    return root


def test_read_apply_and_unset(standin: StandIn) -> None:
    node = node_named(standin, "gpu-4090-0")
    url = f"{standin.url}/v1/client/metadata"
    read = httpx.get(url, params={"node_id": node["ID"]})
    assert read.status_code == 200
    assert read.json() == {"Meta": node["Meta"], "Dynamic": {}, "Static": node["Meta"]}

    applied = httpx.post(url, json={"NodeID": node["ID"], "Meta": {"rack": "r7", "llmgw_gpu_class": None}})
    assert applied.status_code == 200, applied.text
    body = applied.json()
    assert body["Dynamic"] == {"rack": "r7", "llmgw_gpu_class": None}
    assert body["Meta"]["rack"] == "r7" and "llmgw_gpu_class" not in body["Meta"]
    assert body["Static"]["llmgw_gpu_class"] == node["Meta"]["llmgw_gpu_class"]
    assert httpx.get(url, params={"node_id": node["ID"]}).json() == body
    stored = node_named(standin, "gpu-4090-0")
    assert stored["Meta"] == body["Meta"]
    assert stored["ModifyIndex"] > node["ModifyIndex"]
    assert stored["ComputedClass"] != node["ComputedClass"]  # meta is part of the class

    # The write is on the event stream as the node's registration update.
    params = {"topic": f"Node:{node['ID']}", "index": str(stored["ModifyIndex"])}
    with httpx.stream("GET", f"{standin.url}/v1/event/stream", params=params, timeout=10) as stream:
        for line in stream.iter_lines():
            frame = json.loads(line) if line.strip() else {}
            if frame.get("Events"):
                break
    (event,) = frame["Events"]
    assert (event["Topic"], event["Type"], event["Key"]) == ("Node", "NodeRegistration", node["ID"])
    assert event["Payload"]["Node"]["Meta"]["rack"] == "r7"


def test_requests_nomad_refuses(standin: StandIn) -> None:
    url = f"{standin.url}/v1/client/metadata"
    node = node_named(standin, "gpu-4090-0")
    missing = httpx.post(url, json={"Meta": {"a": "b"}})
    assert missing.status_code == 400 and "node_id not provided" in missing.text
    assert httpx.get(url).status_code == 400
    unknown = httpx.post(url, json={"NodeID": "no-such-node", "Meta": {"a": "b"}})
    assert unknown.status_code == 404 and unknown.text == 'Unknown node "no-such-node"'
    empty = httpx.post(url, json={"NodeID": node["ID"], "Meta": {}})
    assert (empty.status_code, empty.text) == (400, "missing required Meta object")
    bad_key = httpx.post(url, json={"NodeID": node["ID"], "Meta": {"not-ok!": "x"}})
    assert bad_key.status_code == 400
    assert bad_key.text == '"not-ok!" is invalid; metadata keys must be valid dotted hcl identifiers'
    number = httpx.post(url, json={"NodeID": node["ID"], "Meta": {"n": 5}})
    assert number.status_code == 400 and "cannot unmarshal number" in number.text
    assert httpx.put(url, json={"NodeID": node["ID"], "Meta": {"a": "b"}}).status_code == 405


def test_node_agent_publishes_only_changes_and_wakes_blocking_queries(
    standin: StandIn, tmp_path: Path
) -> None:
    standin.add_node(tiny_node("bare"))  # a node whose fleet entry has no engine metadata
    node = node_named(standin, "bare")
    agent = make_agent(tmp_path, standin, node["ID"])
    engines = tmp_path / "engines"
    install_llama_cpp_python(engines, "0.3.36")

    # A blocking query on the node, started before the agent publishes, wakes on the write.
    woke: dict[str, Any] = {}

    def watch() -> None:
        response = httpx.get(
            f"{standin.url}/v1/node/{node['ID']}",
            params={"index": node["ModifyIndex"], "wait": "30s"},
            timeout=40,
        )
        woke["node"] = response.json()

    watcher = threading.Thread(target=watch)
    watcher.start()
    sent = agent.run_once()
    watcher.join(20)
    assert not watcher.is_alive(), "the blocking query did not wake"
    assert sent[ENGINE_KEY] == "0.3.36"
    assert woke["node"]["Meta"][ENGINE_KEY] == "0.3.36"
    published = node_named(standin, "bare")
    assert published["Meta"]["llmgw_nvml"] == "unavailable"

    # Nothing changed: nothing is sent and the node is not written.
    assert agent.run_once() == {}
    assert node_named(standin, "bare")["ModifyIndex"] == published["ModifyIndex"]

    # Removing the install unsets its key (a null in Dynamic, gone from Meta).
    (engines / "llama-cpp-python" / "0.3.36").unlink()
    assert agent.run_once()[ENGINE_KEY] is None
    meta = httpx.get(f"{standin.url}/v1/client/metadata", params={"node_id": node["ID"]}).json()
    assert meta["Dynamic"][ENGINE_KEY] is None
    assert ENGINE_KEY not in meta["Meta"]
    assert ENGINE_KEY not in node_named(standin, "bare")["Meta"]


def test_published_engine_version_unblocks_a_model(standin: StandIn, tmp_path: Path) -> None:
    client = standin.client()
    # A node without llama-cpp-python; the model is pinned to it so only the agent's report
    # can make it placeable.
    standin.add_node(tiny_node("bare"))
    target = node_named(standin, "bare")
    assert ENGINE_KEY not in target["Meta"]
    body = mock_job("model-a")
    body["Job"]["Constraints"] = [
        {"LTarget": f"${{meta.{ENGINE_KEY}}}", "RTarget": "0.3.36", "Operand": "set_contains"},
        {"LTarget": "${node.unique.name}", "RTarget": "bare", "Operand": "="},
    ]
    result = client.jobs.register_job(body)
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["FailedTGAllocs"]["g"]["NodesFiltered"] >= 1
    blocked_id = evaluation["BlockedEval"]
    assert client.evaluation.get_evaluation(blocked_id)["Status"] == "blocked"
    assert live_allocs(client, "model-a") == []

    agent = make_agent(tmp_path, standin, target["ID"])
    install_llama_cpp_python(tmp_path / "engines", "0.3.36")
    assert agent.run_once()[ENGINE_KEY] == "0.3.36"

    wait_for(lambda: client.evaluation.get_evaluation(blocked_id)["Status"] == "complete", what="unblock")
    (alloc,) = live_allocs(client, "model-a")
    assert alloc["NodeID"] == target["ID"]
