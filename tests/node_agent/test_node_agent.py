"""The node agent's rules against a fake at the pynvml call boundary (NVML cannot run on these
machines), and against real engine installs on disk: the project's own llama-cpp-python."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nomad_driver.node_agent.agent import NodeAgent, NodeAgentConfig, build_meta, meta_changes
from nomad_driver.node_agent.inventory import EngineScanner, cached_models
from tests.node_agent.fake_nvml import FakeGpu, FakeNVML

H100 = "NVIDIA H100 80GB HBM3"


def two_h100s() -> FakeNVML:
    return FakeNVML(
        [
            FakeGpu(name=H100, uuid="GPU-aaaa", memory_used_mib=1024, utilization=37),
            FakeGpu(name=H100, uuid="GPU-bbbb"),
        ]
    )


def make_agent(tmp_path: Path, nvml: FakeNVML | None, **config: object) -> NodeAgent:
    def loader() -> object:
        if nvml is None:
            raise ImportError("libnvidia-ml.so.1: cannot open shared object file")
        return nvml

    config = {"engines_dir": tmp_path / "engines", "models_dir": tmp_path / "models", **config}
    cfg = NodeAgentConfig(**config)  # type: ignore[arg-type]
    return NodeAgent(cfg, nvml_loader=loader)  # type: ignore[arg-type]


def sample(agent: NodeAgent, metric: str, **labels: str) -> float | None:
    return agent.registry.get_sample_value(metric, labels)


def install_llama_cpp_python(engines: Path, version: str) -> Path:
    # The whole virtualenv, not just its interpreter: a symlinked bin/python alone would not
    # find the venv's pyvenv.cfg and so not its site-packages.
    root = engines / "llama-cpp-python" / version
    root.parent.mkdir(parents=True, exist_ok=True)
    root.symlink_to(sys.prefix, target_is_directory=True)
    return root


def install_llama_server(engines: Path, version: str, prints: str) -> None:
    root = engines / "llama.cpp" / version
    root.mkdir(parents=True)
    binary = root / "llama-server"
    binary.write_text(f"#!/bin/sh\necho '{prints}' >&2\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)


def test_healthy_gpus_publish_class_count_and_no_unhealthy(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, two_h100s(), fabric="ib-a")
    meta = build_meta(agent.inventory(), agent.config)
    assert meta["llmgw_gpu_class"] == H100
    assert meta["llmgw_gpu_count"] == "2"
    assert meta["llmgw_gpus_unhealthy"] == ""
    assert meta["llmgw_fabric"] == "ib-a"
    assert meta["llmgw_nvml"] == "ok"
    agent.metrics.update(agent.inventory())
    assert sample(agent, "llmgw_node_gpu_healthy", uuid="GPU-aaaa", name=H100) == 1
    assert sample(agent, "llmgw_node_gpu_memory_used_bytes", uuid="GPU-aaaa", name=H100) == 1024 * 1024 * 1024
    assert sample(agent, "llmgw_node_gpu_utilization_ratio", uuid="GPU-aaaa", name=H100) == pytest.approx(
        0.37
    )


def test_gpu_that_goes_bad_is_published_as_unhealthy_and_only_that_key_changes(tmp_path: Path) -> None:
    nvml = two_h100s()
    agent = make_agent(tmp_path, nvml)
    first = build_meta(agent.inventory(), agent.config)
    nvml.gpus[1].ecc_uncorrected = 3
    second = build_meta(agent.inventory(), agent.config)
    assert second["llmgw_gpus_unhealthy"] == "GPU-bbbb"
    assert meta_changes(first, second) == {"llmgw_gpus_unhealthy": "GPU-bbbb"}
    agent.metrics.update(agent.inventory())
    assert sample(agent, "llmgw_node_gpu_healthy", uuid="GPU-bbbb", name=H100) == 0
    assert sample(agent, "llmgw_node_gpu_ecc_errors", uuid="GPU-bbbb", name=H100, type="uncorrected") == 3


def test_critical_xid_marks_gpu_unhealthy_but_application_xid_does_not(tmp_path: Path) -> None:
    nvml = two_h100s()
    agent = make_agent(tmp_path, nvml)
    nvml.pending_xids.append((0, 13))  # a faulting kernel: the engine's problem, not the card's
    assert all(g.healthy for g in agent.inventory().gpus or [])
    nvml.pending_xids.append((0, 79))  # fallen off the bus
    gpus = agent.inventory().gpus or []
    assert [g.uuid for g in gpus if not g.healthy] == ["GPU-aaaa"]
    assert "Xid 79" in gpus[0].unhealthy_reasons[0]


def test_retired_pages_pending_marks_gpu_unhealthy(tmp_path: Path) -> None:
    nvml = two_h100s()
    nvml.gpus[0].retired_pending = True
    agent = make_agent(tmp_path, nvml)
    assert build_meta(agent.inventory(), agent.config)["llmgw_gpus_unhealthy"] == "GPU-aaaa"


def test_card_without_ecc_is_healthy_and_reports_no_ecc_series(tmp_path: Path) -> None:
    nvml = FakeNVML(
        [FakeGpu(name="NVIDIA GeForce RTX 4090", uuid="GPU-cccc", ecc_uncorrected=None, ecc_corrected=None)]
    )
    agent = make_agent(tmp_path, nvml)
    inventory = agent.inventory()
    assert inventory.gpus is not None and inventory.gpus[0].healthy
    agent.metrics.update(inventory)
    labels = {"uuid": "GPU-cccc", "name": "NVIDIA GeForce RTX 4090", "type": "uncorrected"}
    assert agent.registry.get_sample_value("llmgw_node_gpu_ecc_errors", labels) is None


def test_without_nvml_it_says_so_once_and_keeps_reporting_engines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_llama_server(tmp_path / "engines", "b6500", "version: 6500 (0c8b5bd)")
    agent = make_agent(tmp_path, None)
    with caplog.at_level(logging.WARNING, logger="llmgw.node_agent"):
        first = build_meta(agent.inventory(), agent.config)
        build_meta(agent.inventory(), agent.config)
    assert first["llmgw_nvml"] == "unavailable"
    assert "llmgw_gpu_class" not in first
    assert first["llmgw_engine_llama_cpp"] == "b6500"
    said = [r for r in caplog.records if "no GPU information" in r.getMessage()]
    assert len(said) == 1
    agent.metrics.update(agent.inventory())
    assert sample(agent, "llmgw_node_nvml_available") == 0


def test_driver_not_loaded_is_reported_like_a_missing_library(tmp_path: Path) -> None:
    agent = make_agent(tmp_path, FakeNVML([FakeGpu()], driver_loaded=False))
    assert agent.inventory().gpus is None


def test_engines_are_verified_by_their_own_version_command(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    install_llama_cpp_python(engines, "0.3.36")  # the venv's real llama-cpp-python
    install_llama_cpp_python(engines, "9.9.9")  # a directory that lies about its version
    install_llama_server(engines, "b6500", "version: 6500 (0c8b5bd)")
    install_llama_server(engines, "b7000", "error while loading shared libraries: libcuda.so.1")
    found = {(e.engine, e.version) for e in EngineScanner(engines).scan()}
    assert found == {("llama-cpp-python", "0.3.36"), ("llama.cpp", "b6500")}


def test_engine_verification_is_cached_until_the_install_changes(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    install_llama_server(engines, "b6500", "version: 6500 (0c8b5bd)")
    scanner = EngineScanner(engines)
    assert [e.version for e in scanner.scan()] == ["b6500"]
    binary = engines / "llama.cpp" / "b6500" / "llama-server"
    binary.write_text("#!/bin/sh\nexit 1\n")
    # Same directory mtime: the cached verdict stands, no process is started per pass.
    os.utime(binary.parent, (binary.parent.stat().st_atime, binary.parent.stat().st_mtime))
    assert [e.version for e in scanner.scan()] == ["b6500"]
    (binary.parent / "touched").write_text("")  # a changed install is verified again
    assert scanner.scan() == []


def test_cached_models_are_directories_holding_weights(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "qwen2.5-0.5b").mkdir(parents=True)
    (models / "qwen2.5-0.5b" / "model.gguf").write_bytes(b"GGUF")
    (models / "half-copied").mkdir()
    assert cached_models(models) == ["qwen2.5-0.5b"]


def test_removed_keys_are_unset_not_left_behind() -> None:
    published = {"llmgw_engine_llama_cpp": "b6500", "llmgw_models_cached": "a"}
    wanted = {"llmgw_models_cached": "a"}
    assert meta_changes(published, wanted) == {"llmgw_engine_llama_cpp": None}
    assert meta_changes(wanted, wanted) == {}


def test_an_uninterpolated_fabric_is_not_published(tmp_path: Path) -> None:
    # Nomad leaves `${meta.llmgw_fabric}` as literal text on a node that does not set it.
    agent = make_agent(tmp_path, two_h100s(), fabric="${meta.llmgw_fabric}")
    assert "llmgw_fabric" not in build_meta(agent.inventory(), agent.config)


def test_an_uninterpolated_models_dir_is_the_default_one(tmp_path: Path) -> None:
    # The dev stack's jobspec passes `--models-dir ${meta.llmgw_models_dir}`, the node's own
    # cache, which a node that does not set it leaves as literal text: publishing that would
    # send every fetch to a directory named "${meta...}".
    agent = make_agent(tmp_path, two_h100s(), models_dir=Path("${meta.llmgw_models_dir}"))
    assert build_meta(agent.inventory(), agent.config)["llmgw_models_dir"] == "/opt/llmgw/models"


def test_publishing_uses_nomads_tls_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    monkeypatch.setenv("NOMAD_CACERT", str(ca))
    from nomad_driver.nomad import tls_from_env

    assert tls_from_env("https://nomad:4646") == (str(ca), ())
    monkeypatch.delenv("NOMAD_CACERT")
    monkeypatch.setenv("NOMAD_CLIENT_CERT", "c.pem")
    monkeypatch.setenv("NOMAD_CLIENT_KEY", "k.pem")
    assert tls_from_env("https://nomad:4646") == (True, ("c.pem", "k.pem"))


def _cuda_llama_server(tmp_path: Path, install: Path) -> None:
    """A real program, built here, that needs `libcudart.so.12` from a host directory that is
    not on this process's library path: what a CUDA build of llama.cpp is inside the agent's
    container. Run on the host (with that directory), it prints llama.cpp's version line."""
    host_lib = tmp_path / "host-cuda"
    host_lib.mkdir()
    (tmp_path / "cudart.c").write_text("int cudaRuntimeGetVersion(int *v) { *v = 12040; return 0; }\n")
    (tmp_path / "server.c").write_text(
        "#include <stdio.h>\nint cudaRuntimeGetVersion(int *);\n"
        'int main(void) { int v; cudaRuntimeGetVersion(&v); printf("version: 6500 (0c1e570)\\n"); return 0; }\n'
    )
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcudart.so.12",
            "-o",
            str(host_lib / "libcudart.so.12"),
            str(tmp_path / "cudart.c"),
        ],
        check=True,
    )
    install.mkdir(parents=True)
    subprocess.run(
        [
            "gcc",
            "-o",
            str(install / "llama-server"),
            str(tmp_path / "server.c"),
            str(host_lib / "libcudart.so.12"),
        ],
        check=True,
    )
    on_host = subprocess.run(
        [str(install / "llama-server"), "--version"],
        env={"LD_LIBRARY_PATH": str(host_lib)},
        capture_output=True,
        text=True,
    )
    assert on_host.stdout.strip() == "version: 6500 (0c1e570)"


def _seal(install: Path) -> None:
    """`sha256sum * > SHA256SUMS` in the install, as `make cuda-engines` writes it."""
    (install / "libggml-cuda.so").write_bytes(os.urandom(4096))
    subprocess.run("sha256sum llama-server libggml-cuda.so > SHA256SUMS", shell=True, cwd=install, check=True)


def test_a_cuda_engine_that_cannot_load_in_the_agents_container_is_advertised_when_sealed(
    tmp_path: Path,
) -> None:
    engines = tmp_path / "engines"
    install = engines / "llama.cpp" / "b6500"
    _cuda_llama_server(tmp_path, install)
    # Unsealed, it is refused: nothing tells a CUDA build from a broken one.
    assert EngineScanner(engines).scan() == []
    _seal(install)
    os.utime(install)
    found = [(e.engine, e.version) for e in EngineScanner(engines).scan()]
    assert found == [("llama.cpp", "b6500")]


def test_a_sealed_install_that_is_half_copied_is_still_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engines = tmp_path / "engines"
    install = engines / "llama.cpp" / "b6500"
    _cuda_llama_server(tmp_path, install)
    _seal(install)
    library = install / "libggml-cuda.so"
    library.write_bytes(library.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        assert EngineScanner(engines).scan() == []
    assert "libcudart.so.12" in caplog.text
    assert "libggml-cuda.so does not match its checksum in SHA256SUMS" in caplog.text
