"""Issue 33, item 5: slowloris over HTTPS. A connection that opens a TLS port and never sends
its ClientHello was neither timed by the head deadline nor counted by the connection cap: the
guard only saw a connection once its handshake had ended, and asyncio's own handshake timeout
is 60 s, so a few thousand of them held every file descriptor for a minute at a time."""

from __future__ import annotations

import ssl
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from router.config import Limits, Timeouts
from tests.hostile.conftest import GuardedRouter
from tests.hostile.test_slow_clients import Attacker, router_port
from tests.router.conftest import RunningRouter, wait_until, write_self_signed

pytestmark = pytest.mark.timeout(120)


def tls_router(
    guarded_router: GuardedRouter, consul_url: str, tmp_path: Path, **overrides: object
) -> RunningRouter:
    cert, key, _ = write_self_signed(tmp_path)
    router = guarded_router(consul_url, tls_cert=str(cert), tls_key=str(key), **overrides)
    router.verify = ssl.create_default_context(cafile=str(cert))  # type: ignore[attr-defined]
    return router


def test_silent_tls_sockets_are_closed_at_the_head_deadline(
    consul_url: str, guarded_router: GuardedRouter, tmp_path: Path
) -> None:
    router = tls_router(guarded_router, consul_url, tmp_path, timeouts=Timeouts(request_head_s=1.0))
    started = time.monotonic()
    attackers = [Attacker(router_port(router.url)) for _ in range(5)]
    try:
        # The head deadline is 1 s; asyncio's handshake timeout, all there was before, is 60 s.
        wait_until(lambda: all(a.poll() for a in attackers), 15, "the silent TLS sockets closed")
        assert time.monotonic() - started < 15
        assert all(a.answer == b"" for a in attackers), "closed without a word, as a silent plain socket"
        router.expect_metric("llmgw_router_connections_closed_total", 5, reason="silent")
        # HTTPS itself still works, a new connection each time: a ClientHello that arrives
        # before the handshake is set up (one in four here, under uvloop) is not lost.
        for _ in range(12):
            resp = httpx.get(f"{router.url}/healthz", verify=router.verify, timeout=10)  # type: ignore[attr-defined]
            assert resp.status_code == 200
    finally:
        for attacker in attackers:
            attacker.close()


def test_tls_sockets_in_their_handshake_count_toward_the_connection_cap(
    consul_url: str, guarded_router: GuardedRouter, tmp_path: Path
) -> None:
    cap = 20
    router = tls_router(
        guarded_router,
        consul_url,
        tmp_path,
        timeouts=Timeouts(request_head_s=60.0),
        limits=replace(Limits(), max_connections=cap),
    )
    port = router_port(router.url)
    attackers = [Attacker(port) for _ in range(2 * cap)]
    try:
        # Past the cap, the oldest silent ones make room, long before any deadline.
        wait_until(lambda: all(a.poll() for a in attackers[:cap]), 15, "the oldest attackers closed")
        assert not any(a.poll() for a in attackers[-cap // 2 :]), "the newest are still held"
        assert router.metric("llmgw_router_connections_closed_total", reason="idle_over_cap") >= cap
        # A client that completes its handshake and asks is served beside them.
        resp = httpx.get(f"{router.url}/healthz", verify=router.verify, timeout=10)  # type: ignore[attr-defined]
        assert resp.status_code == 200
    finally:
        for attacker in attackers:
            attacker.close()
