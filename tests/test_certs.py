"""Certificate expiry metrics, with certificates made here with `cryptography` and read through a
real prometheus-client registry, as a scrape would."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry, generate_latest

from nomad_driver.certs import CertExpiryCollector, cert_paths_from_env, read_expiry, register_cert_collector

NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def make_cert(days: float, name: str = "llmgw.test") -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )


def pem(*certs: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def expiry_of(days: float) -> float:
    return (NOW + dt.timedelta(days=days)).timestamp()


def scrape(registry: CollectorRegistry, name: str, path: str) -> float | None:
    """One scrape, one sample."""
    return registry.get_sample_value(name, {"path": path})


def scrape_all(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """One scrape, every sample, keyed by (name, path)."""
    return {
        (sample.name, sample.labels["path"]): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def replace_file(path: Path, data: bytes) -> None:
    # The way renewal tools write: a new file moved over the old one.
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_expiry_is_published_per_path(tmp_path: Path) -> None:
    nomad, consul = tmp_path / "nomad.pem", tmp_path / "consul.pem"
    nomad.write_bytes(pem(make_cert(10)))
    consul.write_bytes(pem(make_cert(90)))
    registry = CollectorRegistry()
    registry.register(CertExpiryCollector([str(nomad), str(consul)]))

    assert scrape(registry, "llmgw_tls_cert_expiry_timestamp_seconds", str(nomad)) == expiry_of(10)
    assert scrape(registry, "llmgw_tls_cert_expiry_timestamp_seconds", str(consul)) == expiry_of(90)
    assert scrape(registry, "llmgw_tls_cert_read_errors_total", str(nomad)) == 0
    text = generate_latest(registry).decode()
    assert f'llmgw_tls_cert_expiry_timestamp_seconds{{path="{nomad}"}}' in text


def test_renewed_file_shows_at_the_next_scrape(tmp_path: Path) -> None:
    path = tmp_path / "router.pem"
    path.write_bytes(pem(make_cert(3)))
    registry = CollectorRegistry()
    registry.register(CertExpiryCollector([str(path)]))
    assert scrape(registry, "llmgw_tls_cert_expiry_timestamp_seconds", str(path)) == expiry_of(3)

    replace_file(path, pem(make_cert(365)))

    assert scrape(registry, "llmgw_tls_cert_expiry_timestamp_seconds", str(path)) == expiry_of(365)


def test_unreadable_file_is_counted_not_a_crash(tmp_path: Path) -> None:
    good, garbage, missing = tmp_path / "good.pem", tmp_path / "garbage.pem", tmp_path / "missing.pem"
    good.write_bytes(pem(make_cert(30)))
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    registry = CollectorRegistry()
    registry.register(CertExpiryCollector([str(good), str(garbage), str(missing)]))

    for scrapes in (1, 2, 3):
        samples = scrape_all(registry)
        assert samples[("llmgw_tls_cert_expiry_timestamp_seconds", str(good))] == expiry_of(30)
        # No expiry for what cannot be read: an old value would say all is well.
        assert ("llmgw_tls_cert_expiry_timestamp_seconds", str(missing)) not in samples
        assert ("llmgw_tls_cert_expiry_timestamp_seconds", str(garbage)) not in samples
        assert samples[("llmgw_tls_cert_read_errors_total", str(missing))] == scrapes
        assert samples[("llmgw_tls_cert_read_errors_total", str(garbage))] == scrapes
        assert samples[("llmgw_tls_cert_read_errors_total", str(good))] == 0
    assert f'llmgw_tls_cert_read_errors_total{{path="{missing}"}} 4.0' in generate_latest(registry).decode()


def test_file_that_becomes_readable_publishes_again(tmp_path: Path) -> None:
    path = tmp_path / "late.pem"
    collector = CertExpiryCollector([str(path)])
    registry = CollectorRegistry()
    registry.register(collector)
    assert scrape(registry, "llmgw_tls_cert_read_errors_total", str(path)) == 1

    path.write_bytes(pem(make_cert(20)))

    assert scrape(registry, "llmgw_tls_cert_expiry_timestamp_seconds", str(path)) == expiry_of(20)
    # The count of past failures stays: it is a counter, and the alert looks at its increase.
    assert scrape(registry, "llmgw_tls_cert_read_errors_total", str(path)) == 1


def test_a_bundle_reports_its_earliest_expiry(tmp_path: Path) -> None:
    bundle = tmp_path / "ca-bundle.pem"
    bundle.write_bytes(pem(make_cert(400, "new ca"), make_cert(12, "old ca")))
    assert read_expiry(str(bundle)) == expiry_of(12)


def test_der_certificate_is_read(tmp_path: Path) -> None:
    der = tmp_path / "client.der"
    der.write_bytes(make_cert(50).public_bytes(serialization.Encoding.DER))
    assert read_expiry(str(der)) == expiry_of(50)


def test_paths_come_from_hashicorp_variables_and_llmgw_config() -> None:
    env = {
        "NOMAD_CLIENT_CERT": "/etc/nomad.d/client.pem",
        "NOMAD_CACERT": "/etc/nomad.d/ca.pem",
        "CONSUL_CLIENT_CERT": "/etc/consul.d/client.pem",
        "CONSUL_CACERT": "/etc/nomad.d/ca.pem",  # shared CA: reported once
        "LLMGW_ROUTER_TLS_CERT": "/etc/llmgw/router.pem",
        "LLMGW_TLS_CERTS": " /etc/llmgw/a.pem, ,/etc/llmgw/b.pem",
        "NOMAD_CLIENT_KEY": "/etc/nomad.d/client-key.pem",  # keys have no expiry
    }
    assert cert_paths_from_env(env, extra=["/srv/serving.pem"]) == [
        "/etc/nomad.d/client.pem",
        "/etc/nomad.d/ca.pem",
        "/etc/consul.d/client.pem",
        "/etc/llmgw/router.pem",
        "/etc/llmgw/a.pem",
        "/etc/llmgw/b.pem",
        "/srv/serving.pem",
    ]
    assert cert_paths_from_env({}) == []


def test_register_reads_nothing_until_scraped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "absent.pem"
    registry = CollectorRegistry()
    collector = register_cert_collector(registry, env={"LLMGW_TLS_CERTS": str(path)})
    assert collector.paths == [str(path)]
    assert "absent.pem" not in caplog.text
    generate_latest(registry)
    assert f"cannot read certificate {path}" in caplog.text
