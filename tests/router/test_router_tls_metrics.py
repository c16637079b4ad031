"""The router's serving certificate is in its own /metrics, with the expiry read from disk."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.router.conftest import StartRouter


def write_cert_and_key(directory: Path, days: int) -> tuple[Path, Path, float]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "router.pem", directory / "router-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path, cert.not_valid_after_utc.timestamp()


def test_a_router_serving_tls_publishes_its_certificates_expiry(
    start_router: StartRouter, consul_url: str, tmp_path: Path
) -> None:
    cert, key, expiry = write_cert_and_key(tmp_path, days=10)
    router = start_router(consul_url, tls_cert=str(cert), tls_key=str(key))
    assert router.url.startswith("https://")
    text = httpx.get(f"{router.url}/metrics", verify=False, timeout=10).text
    line = f'llmgw_tls_cert_expiry_timestamp_seconds{{path="{cert}"}} '
    published = [ln for ln in text.splitlines() if ln.startswith(line)]
    assert published, f"no expiry for {cert} in the router's metrics"
    assert float(published[0].split()[-1]) == expiry

    # Renewed on disk: the next scrape shows the new expiry, without a restart.
    _, _, renewed = write_cert_and_key(tmp_path, days=90)
    text = httpx.get(f"{router.url}/metrics", verify=False, timeout=10).text
    assert any(ln.startswith(line) and float(ln.split()[-1]) == renewed for ln in text.splitlines())
