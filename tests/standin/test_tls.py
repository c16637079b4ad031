"""The stand-in serves Nomad's API over HTTPS (`--tls-cert`, `--tls-key`), as an agent with
`tls { http = true }` does, so the dev stack can run with TLS: llmgw's Nomad client verifies it
with NOMAD_CACERT against a certificate of only the names `nomad tls cert create` gives."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devstack.agent_tls import AgentTLS, write_agent_certificates
from devstack.nomad_agent import start_standin
from nomad_driver.nomad import Nomad, NomadUnavailable

NODES = Path(__file__).resolve().parents[2] / "devstack" / "nodes" / "small.yaml"


@pytest.fixture
def https_standin(tmp_path: Path, consul_url: str) -> Iterator[tuple[str, AgentTLS]]:
    tls = write_agent_certificates(tmp_path / "tls")
    proc, url = start_standin(
        nodes=NODES,
        consul_url=consul_url,
        data_dir=tmp_path / "data",
        log=tmp_path / "standin.log",
        clock_speed=1.0,
        tls=tls,
    )
    try:
        yield url, tls
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_llmgw_reads_the_standin_over_https_with_nomad_cacert(
    https_standin: tuple[str, AgentTLS], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, tls = https_standin
    assert url.startswith("https://localhost:")
    monkeypatch.setenv("NOMAD_CACERT", str(tls.ca))
    _, jobs = Nomad(url, timeout=5).llmgw_jobs()
    assert jobs == []
    # 127.0.0.1 is in the certificate too, as `nomad tls cert create` puts it there.
    _, jobs = Nomad(url.replace("localhost", "127.0.0.1"), timeout=5).llmgw_jobs()
    assert jobs == []


def test_without_its_ca_the_standins_certificate_is_refused(
    https_standin: tuple[str, AgentTLS], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = https_standin
    monkeypatch.delenv("NOMAD_CACERT", raising=False)
    with pytest.raises(NomadUnavailable, match=r"certificate|verify"):
        Nomad(url, timeout=5).llmgw_jobs()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/v1/jobs", timeout=5).raise_for_status()
