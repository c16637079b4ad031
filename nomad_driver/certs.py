"""Certificate expiry, read from disk at every scrape.

Reading at scrape time rather than at start-up is the point: a certificate renewed on disk
shows its new expiry at the next scrape, without restarting the watcher or router, so the
expiry alert clears the moment the renewal lands and never fires on a file already replaced.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from cryptography import x509
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

log = logging.getLogger(__name__)

# HashiCorp's own variables first, so the certificates every llmgw process uses are covered
# without extra configuration.
HASHICORP_CERT_VARS = ("NOMAD_CLIENT_CERT", "NOMAD_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CACERT")
# The router's serving certificate, when it terminates TLS itself.
ROUTER_CERT_VAR = "LLMGW_ROUTER_TLS_CERT"
# Any other certificate an operator wants watched, comma-separated.
EXTRA_CERTS_VAR = "LLMGW_TLS_CERTS"


class CertReadError(Exception):
    """A certificate file that could not be read or holds no certificate; names the file."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"cannot read certificate {path}: {detail}")
        self.path = path


def cert_paths_from_env(env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Every certificate path llmgw uses, in a stable order, each once."""
    env = os.environ if env is None else env
    candidates: list[str] = [env.get(name, "") for name in (*HASHICORP_CERT_VARS, ROUTER_CERT_VAR)]
    candidates.extend(env.get(EXTRA_CERTS_VAR, "").split(","))
    candidates.extend(extra)
    paths: list[str] = []
    for raw in candidates:
        path = raw.strip()
        if path and path not in paths:
            paths.append(path)
    return paths


def read_expiry(path: str) -> float:
    """The Unix time at which the certificate in `path` stops being valid.

    A file with several certificates (a chain, a CA bundle) answers with the earliest: that is
    the one whose expiry breaks a TLS handshake first.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CertReadError(path, exc.strerror or str(exc)) from exc
    try:
        if b"-----BEGIN" in data:
            certs = x509.load_pem_x509_certificates(data)
        else:
            certs = [x509.load_der_x509_certificate(data)]
    except ValueError as exc:
        raise CertReadError(path, f"not a PEM or DER certificate ({exc})") from exc
    if not certs:
        raise CertReadError(path, "no certificate in the file")
    return min(cert.not_valid_after_utc.timestamp() for cert in certs)


class CertExpiryCollector:
    """A prometheus-client collector: `llmgw_tls_cert_expiry_timestamp_seconds{path}` and
    `llmgw_tls_cert_read_errors_total{path}`.

    A file that cannot be read publishes no expiry (an old value would claim a certificate we
    can no longer see is fine) and counts an error, which has its own alert; it never fails the
    scrape, because the other metrics on the same endpoint matter more than one file.
    """

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = list(dict.fromkeys(paths))
        self._errors = dict.fromkeys(self.paths, 0)
        self._last_error: dict[str, str] = {}
        # Scrapes can overlap (two Prometheus servers); the counter must not lose increments.
        self._lock = threading.Lock()

    def describe(self) -> Iterator[Metric]:
        # Declared without reading any file, so registering never touches the disk.
        yield GaugeMetricFamily("llmgw_tls_cert_expiry_timestamp_seconds", "", labels=["path"])
        yield CounterMetricFamily("llmgw_tls_cert_read_errors", "", labels=["path"])

    def collect(self) -> Iterator[Metric]:
        expiry = GaugeMetricFamily(
            "llmgw_tls_cert_expiry_timestamp_seconds",
            "Unix time at which the certificate at path expires (earliest in the file), read at each scrape.",
            labels=["path"],
        )
        errors = CounterMetricFamily(
            "llmgw_tls_cert_read_errors",
            "Scrapes at which the certificate at path could not be read or parsed.",
            labels=["path"],
        )
        for path in self.paths:
            try:
                expiry.add_metric([path], read_expiry(path))
            except CertReadError as exc:
                self._count_error(path, str(exc))
            except Exception as exc:
                self._count_error(path, f"cannot read certificate {path}: {exc!r}")
            else:
                self._last_error.pop(path, None)
            with self._lock:
                count = self._errors[path]
            errors.add_metric([path], count)
        yield expiry
        yield errors

    def _count_error(self, path: str, message: str) -> None:
        with self._lock:
            self._errors[path] += 1
        # Logged when the error changes, not at every scrape: the counter carries the rate.
        if self._last_error.get(path) != message:
            log.warning("%s; its expiry is not published until it can be read", message)
            self._last_error[path] = message


def register_cert_collector(
    registry: CollectorRegistry = REGISTRY,
    env: Mapping[str, str] | None = None,
    extra: Iterable[str] = (),
) -> CertExpiryCollector:
    """Register the collector for every certificate llmgw uses; returns it for tests and logs."""
    collector = CertExpiryCollector(cert_paths_from_env(env, extra))
    registry.register(collector)
    return collector
