"""Certificates for the dev stack's Nomad and Consul APIs over HTTPS (`python -m devstack up
--tls`), with only the names `nomad tls cert create -server` and `consul tls cert create -server`
give (hashicorp/nomad command/tls_cert_create.go `recordPreparation`): the role
(`server.global.nomad`, `server.dc1.consul`), `localhost` and 127.0.0.1, signed by a CA of their
own. So an address the certificate does not name fails verification here as on a cluster, and
NOMAD_CACERT or CONSUL_CACERT is what makes it pass.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NOMAD_SERVER_NAME = "server.global.nomad"
CONSUL_SERVER_NAME = "server.dc1.consul"  # `consul tls cert create -server`


@dataclass(frozen=True)
class AgentTLS:
    ca: Path  # NOMAD_CACERT for every client
    cert: Path
    key: Path


def verify(ca: Path | None) -> ssl.SSLContext | bool:
    """NOMAD_CACERT as httpx takes it: a context trusting that CA, or the system's CAs."""
    return ssl.create_default_context(cafile=str(ca)) if ca else True


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_agent_certificates(directory: Path, role_name: str = NOMAD_SERVER_NAME, days: int = 30) -> AgentTLS:
    """A CA (`agent-ca.pem`) and a server certificate and key it signed, in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role_name} CA (llmgw dev stack)")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
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
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    tls = AgentTLS(directory / "agent-ca.pem", directory / "server.pem", directory / "server-key.pem")
    tls.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    tls.key.write_bytes(_pem_key(key))
    tls.key.chmod(0o600)
    return tls
