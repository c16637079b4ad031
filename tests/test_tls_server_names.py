"""TLS as the `nomad` and `consul` CLIs speak it, against certificates with only the names
`nomad tls cert create` and `consul tls cert create` give (the role name, `localhost`,
127.0.0.1; hashicorp/nomad command/tls_cert_create.go `recordPreparation`), reached at an
address they do not name (127.0.0.2), as a node IP or `nomad.service.consul` would be.

Consul is a real dev agent serving HTTPS on 127.0.0.2. No Nomad binary runs here and the
stand-in speaks plain HTTP, so Nomad's side is a TLS server answering `/v1/jobs` as Nomad does:
what is under test is the handshake, which is the client's."""

from __future__ import annotations

import asyncio
import datetime as dt
import http.server
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from devstack.consul_agent import ConsulAgent
from devstack.ports import free_ports
from nomad_driver.consul import Consul, ConsulUnavailable, KVEntry
from nomad_driver.endpoint import TLSConfigError, consul_tls, nomad_tls
from nomad_driver.nomad import Nomad, NomadUnavailable
from router.config import from_env as router_from_env

OTHER_ADDRESS = "127.0.0.2"  # on loopback, and in no certificate below
NOW = dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_pki(directory: Path, role_name: str) -> tuple[Path, Path, Path]:
    """(ca.pem, cert.pem, key.pem): a CA and a server certificate with the names HashiCorp's
    `tls cert create -server` gives: the role name and localhost, and the IP 127.0.0.1."""
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = [
        x509.DNSName(role_name),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


class _Jobs(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps([]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Nomad-Index", "7")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def nomad_tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    ca, cert, key = make_pki(tmp_path, "server.global.nomad")
    server = http.server.ThreadingHTTPServer((OTHER_ADDRESS, 0), _Jobs)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://{OTHER_ADDRESS}:{server.server_address[1]}", ca
    server.shutdown()
    server.server_close()


def test_nomad_is_verified_against_nomad_tls_server_name(
    nomad_tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, ca = nomad_tls_server
    monkeypatch.setenv("NOMAD_CACERT", str(ca))
    # The certificate does not name 127.0.0.2: refused, as the nomad CLI refuses it.
    with pytest.raises(NomadUnavailable, match=r"certificate|hostname|match"):
        Nomad(addr, timeout=5).llmgw_jobs()
    monkeypatch.setenv("NOMAD_TLS_SERVER_NAME", "server.global.nomad")
    assert Nomad(addr, timeout=5).llmgw_jobs() == (7, [])
    # A name the certificate does not carry is refused even so: the name is checked, not skipped.
    monkeypatch.setenv("NOMAD_TLS_SERVER_NAME", "nomad.service.consul")
    with pytest.raises(NomadUnavailable):
        Nomad(addr, timeout=5).llmgw_jobs()


def test_nomad_skip_verify_is_read_as_the_cli_reads_it(
    nomad_tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, _ = nomad_tls_server
    monkeypatch.setenv("NOMAD_SKIP_VERIFY", "1")
    assert Nomad(addr, timeout=5).llmgw_jobs() == (7, [])
    monkeypatch.setenv("NOMAD_SKIP_VERIFY", "false")
    with pytest.raises(NomadUnavailable):
        Nomad(addr, timeout=5).llmgw_jobs()
    monkeypatch.setenv("NOMAD_SKIP_VERIFY", "yes please")
    with pytest.raises(TLSConfigError, match="NOMAD_SKIP_VERIFY='yes please' is not a boolean"):
        Nomad(addr, timeout=5)


def test_the_variables_are_read_with_the_clis_rules() -> None:
    env = {"CONSUL_TLS_SERVER_NAME": "server.dc1.consul:8501", "CONSUL_HTTP_SSL_VERIFY": "F"}
    assert consul_tls(env).server_name == "server.dc1.consul"  # Consul drops the port
    assert consul_tls(env).skip_verify is True
    assert consul_tls({"CONSUL_HTTP_SSL_VERIFY": "true"}).skip_verify is False
    assert nomad_tls({"NOMAD_TLS_SERVER_NAME": "", "NOMAD_SKIP_VERIFY": ""}).server_name == ""
    with pytest.raises(TLSConfigError, match="CONSUL_HTTP_SSL_VERIFY"):
        consul_tls({"CONSUL_HTTP_SSL_VERIFY": "no"})
    # The router reads them from the same variables.
    config = router_from_env({"CONSUL_HTTP_ADDR": "https://127.0.0.2:8501", "CONSUL_HTTP_SSL_VERIFY": "0"})
    assert config.consul.skip_verify is True
    # CONSUL_HTTP_SSL keeps even an http:// address on TLS, as Consul's client does.
    http_addr = router_from_env({"CONSUL_HTTP_ADDR": "http://127.0.0.1:8501", "CONSUL_HTTP_SSL": "true"})
    assert http_addr.consul.addr == "https://127.0.0.1:8501"


@pytest.fixture(scope="module")
def consul_https(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real Consul dev agent whose HTTPS listener is on 127.0.0.2 only."""
    directory = tmp_path_factory.mktemp("consul-tls")
    ca, cert, key = make_pki(directory, "server.dc1.consul")
    (port,) = free_ports(1, OTHER_ADDRESS)
    agent = ConsulAgent(
        log_dir=directory,
        die_with_parent=True,
        extra_args=(
            "-hcl",
            f"ports {{ https = {port} }}",
            "-hcl",
            f'addresses {{ https = "{OTHER_ADDRESS}" }}',
            "-hcl",
            f'cert_file = "{cert}"',
            "-hcl",
            f'key_file = "{key}"',
            "-hcl",
            f'ca_file = "{ca}"',
        ),
    )
    agent.start()
    yield f"https://{OTHER_ADDRESS}:{port}", ca
    agent.stop()


def _read(addr: str) -> tuple[int, list[KVEntry]]:
    async def go() -> tuple[int, list[KVEntry]]:
        consul = Consul(addr, timeout=5)
        try:
            return await consul.kv_get("llmgw/none")
        finally:
            await consul.close()

    return asyncio.run(go())


def test_consul_is_verified_against_consul_tls_server_name(
    consul_https: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, ca = consul_https
    monkeypatch.setenv("CONSUL_CACERT", str(ca))
    with pytest.raises(ConsulUnavailable, match=r"certificate|hostname|match"):
        _read(addr)
    monkeypatch.setenv("CONSUL_TLS_SERVER_NAME", "server.dc1.consul:8501")
    index, entries = _read(addr)
    assert entries == [] and index >= 1
    monkeypatch.setenv("CONSUL_TLS_SERVER_NAME", "consul.service.consul")
    with pytest.raises(ConsulUnavailable):
        _read(addr)


def test_consul_ssl_verify_false_skips_verification(
    consul_https: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    addr, _ = consul_https
    with pytest.raises(ConsulUnavailable):
        _read(addr)  # the system's CAs know nothing of this one
    monkeypatch.setenv("CONSUL_HTTP_SSL_VERIFY", "false")
    _index, entries = _read(addr)
    assert entries == []
