"""The router's serving certificate is in its own /metrics, with the expiry read from disk."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.router.conftest import StartRouter, write_self_signed


def test_a_router_serving_tls_publishes_its_certificates_expiry(
    start_router: StartRouter, consul_url: str, tmp_path: Path
) -> None:
    cert, key, expiry = write_self_signed(tmp_path, days=10)
    router = start_router(consul_url, tls_cert=str(cert), tls_key=str(key))
    assert router.url.startswith("https://")
    text = httpx.get(f"{router.url}/metrics", verify=False, timeout=10).text
    line = f'llmgw_tls_cert_expiry_timestamp_seconds{{path="{cert}"}} '
    published = [ln for ln in text.splitlines() if ln.startswith(line)]
    assert published, f"no expiry for {cert} in the router's metrics"
    assert float(published[0].split()[-1]) == expiry

    # Renewed on disk: the next scrape shows the new expiry, without a restart.
    _, _, renewed = write_self_signed(tmp_path, days=90)
    text = httpx.get(f"{router.url}/metrics", verify=False, timeout=10).text
    assert any(ln.startswith(line) and float(ln.split()[-1]) == renewed for ln in text.splitlines())
