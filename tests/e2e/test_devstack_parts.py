"""The dev stack's parts that need no running stack: the files `devstack up` writes, the
engines link, and stopping a process group with everything its leader started."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from devstack import demo_models, fleet, processes, s3_weights
from devstack.nomad.nodes import load_nodes
from nomad_driver.fetch.render import HOST_VOLUME
from nomad_driver.fetch.sources import is_fetched
from nomad_driver.placement import choose_fabric, eligible_nodes, fabric_rooms
from nomad_driver.spec import load_models, parse_models


def _say(text: str) -> None:
    pass


def test_demo_template_is_a_valid_models_file_with_the_five_demo_models() -> None:
    models = parse_models(demo_models.TEMPLATE.read_text(), str(demo_models.TEMPLATE))
    assert set(models.models) == {
        "gemma-3-270m",
        "gemma-3-270m-on-demand",
        "gemma-3-270m-split",
        "kev-0.5b",
        "phi-4",
    }
    split = models.models["gemma-3-270m-split"]
    assert (split.profile.engine, split.profile.nodes) == ("llama.cpp", 2)
    assert split.source == models.models["gemma-3-270m"].source
    assert models.models["gemma-3-270m-on-demand"].replicas_min == 0
    assert models.models["gemma-3-270m"].profile.chat_format == "gemma"


def test_effective_models_file_points_at_weights_that_exist(tmp_path: Path) -> None:
    models_dir, real = demo_models.prepare_weights(tmp_path / "models", tiny=True, say=_say)
    assert real is False
    out = demo_models.write_effective_models(tmp_path / "models.yaml", models_dir)
    text = out.read_text()
    assert demo_models.PLACEHOLDER not in text
    for name, model in load_models(out).models.items():
        path = Path(urlsplit(model.source).path)
        assert path.is_absolute() and path.is_file(), f"{name}: {model.source} is not a file here"
    kev = load_models(out).models["kev-0.5b"].source
    assert b"kev" in Path(urlsplit(kev).path).read_bytes()[:4096]


def test_engines_link_runs_llama_cpp_from_the_virtualenv(tmp_path: Path) -> None:
    link = fleet.install_engines(tmp_path / "engines")
    assert link == tmp_path / "engines" / "llama-cpp-python" / "0.3.36"
    # What a job runs: <engines_dir>/llama-cpp-python/<version>/bin/python -m llama_cpp.server.
    out = subprocess.run(
        [
            str(link / "bin" / "python"),
            "-c",
            "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.3.36"


def test_effective_nodes_offer_the_stacks_engines_dir(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    out = fleet.effective_nodes(fleet.SMALL_FLEET, engines, tmp_path / "nodes.yaml")
    nodes = load_nodes(out)
    assert len(nodes) == len(yaml.safe_load(fleet.SMALL_FLEET.read_text())["nodes"])
    assert {n["Meta"]["llmgw_engines_dir"] for n in nodes} == {str(engines.resolve())}


def test_stop_group_stops_what_the_child_started_too(tmp_path: Path) -> None:
    proc = processes.spawn("shell", ["sh", "-c", "sleep 300 & sleep 300"], tmp_path / "shell.log")
    deadline = time.monotonic() + 10
    while len(processes.group_members(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = processes.group_members(proc.pid)
    assert len(members) >= 2  # the shell and its background sleep, at least
    assert processes.stop_group(proc.pid, timeout=10)
    assert not [pid for pid in members if processes.alive(pid)]


def test_the_demo_fleet_has_one_fabric_entirely_free_for_the_split_model_and_only_for_it(
    tmp_path: Path,
) -> None:
    models = parse_models(demo_models.TEMPLATE.read_text()).models
    out = fleet.effective_nodes(
        fleet.DEMO_FLEET, tmp_path / "engines", tmp_path / "nodes.yaml", gpu_pool="gpu"
    )
    nodes = load_nodes(out)
    split = models["gemma-3-270m-split"]
    rooms = fabric_rooms(eligible_nodes(nodes, split.profile), [], split.name)
    assert [(r.fabric, r.largest_free_block) for r in rooms] == [("roce-a", 2)]
    assert choose_fabric(rooms, split.profile.nodes) == "roce-a"
    # The single-node demo models cannot take a card there: the two nodes stay entirely free.
    pools = {n["Name"]: n["NodePool"] for n in nodes}
    assert {pools["gpu-a10-0"], pools["gpu-a10-1"]} == {"multinode"}
    for name, model in models.items():
        if model.profile.nodes == 1:
            assert model.profile.node_pool == "gpu", name
    # The small fleet the tests use is the demo fleet without them.
    small = {n["name"] for n in yaml.safe_load(fleet.SMALL_FLEET.read_text())["nodes"]}
    assert set(pools) - small == {"gpu-a10-0", "gpu-a10-1", "general-0"}


def test_with_s3_every_gpu_node_has_a_weights_cache_and_tiny_s3_is_fetched_from_s3(tmp_path: Path) -> None:
    """What `devstack up --s3` writes before Nomad starts: the fetch's host volume and
    `llmgw_models_dir` on each GPU node (a cache of its own), and tiny-s3 beside the demo's models."""
    nodes = fleet.effective_nodes(
        fleet.DEMO_FLEET, tmp_path / "engines", tmp_path / "nodes.yaml", gpu_pool="gpu"
    )
    s3_weights.give_nodes_caches(nodes, tmp_path / "weights")
    loaded = load_nodes(nodes)
    gpu_nodes = [n for n in loaded if n["NodeClass"] != "general"]
    assert gpu_nodes
    for node in gpu_nodes:
        cache = tmp_path / "weights" / node["Name"]
        assert node["Meta"]["llmgw_models_dir"] == str(cache) and cache.is_dir()
        assert node["HostVolumes"][HOST_VOLUME]["Path"] == str(cache)
    models_dir, _ = demo_models.prepare_weights(tmp_path / "models", tiny=True, say=_say)
    out = demo_models.write_effective_models(tmp_path / "models.yaml", models_dir)
    source = f"s3://{s3_weights.BUCKET}/{s3_weights.KEY}?region=us-east-1&endpoint=http://127.0.0.1:9"
    s3_weights.add_model(out, source)
    models = load_models(out).models
    assert set(demo_models.EXPECTED) < set(models)
    assert models[s3_weights.MODEL].source == source and is_fetched(source)
