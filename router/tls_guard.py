"""HTTPS under the connection guard: the TLS handshake is part of a request's head.

Served through uvicorn's own TLS (`ssl=` to `create_server`), a connection reaches the guarded
protocol only once its handshake is done, so one that never sends its ClientHello was neither
timed by the head deadline nor counted by the connection cap until asyncio's 60 s handshake
timeout: a few thousand of them held the router's file descriptors a minute at a time. So the
router listens on plain TCP and the protocol, timed and counted from the opening as any
connection is, upgrades itself with `loop.start_tls` (router/server.py, `GuardedProtocol`).
"""

from __future__ import annotations

import asyncio
import ssl
import typing
from typing import Protocol

from uvicorn.config import create_ssl_context


def server_context(cert: str, key: str, alpn: list[str] | None) -> ssl.SSLContext:
    """uvicorn's own server context, with uvicorn's defaults."""
    return create_ssl_context(
        certfile=cert,
        keyfile=key or None,
        password=None,
        ssl_version=ssl.PROTOCOL_TLS_SERVER,
        cert_reqs=ssl.CERT_NONE,
        ca_certs=None,
        ciphers=None,
        alpn_protocols=alpn,
    )


class Upgrading(Protocol):
    """What `upgrade` needs of the guarded protocol."""

    loop: asyncio.AbstractEventLoop
    handshaking: bool
    early: list[bytes]

    def connection_lost(self, exc: Exception | None) -> None: ...

    def switch_to(self, transport: asyncio.BaseTransport) -> None: ...


async def upgrade(
    proto: Upgrading, raw: asyncio.Transport, context: ssl.SSLContext, timeout_s: float
) -> None:
    """The handshake on `raw`, then `proto` answers through TLS; a handshake that fails, or a
    connection closed during it (the head deadline, the cap), ends `proto` as a lost connection,
    which the TLS layer would not tell it of."""
    # uvloop starts reading after connection_made whatever it paused, so a ClientHello may have
    # reached the protocol before start_tls took the transport over: handed to the TLS layer
    # right after its own connection_made (call_soon callbacks run in order).
    hello, proto.early = b"".join(proto.early), []
    if hello:
        proto.loop.call_soon(proto.loop.call_soon, _feed, raw, hello)
    error: Exception | None = None
    tls: asyncio.BaseTransport | None = None
    try:
        protocol = typing.cast(asyncio.BaseProtocol, proto)
        tls = await proto.loop.start_tls(
            raw, protocol, context, server_side=True, ssl_handshake_timeout=timeout_s
        )
    except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
        error = exc
    if not proto.handshaking:
        return  # lost meanwhile; connection_lost has run
    proto.handshaking = False
    if tls is None or tls.is_closing():
        raw.close()
        proto.connection_lost(error)
        return
    proto.switch_to(tls)


def _feed(transport: asyncio.Transport, data: bytes) -> None:
    """Bytes read before the TLS layer took `transport` over, given to it as if read now."""
    proto = transport.get_protocol()
    if hasattr(proto, "get_buffer"):  # asyncio's and uvloop's TLS layers are buffered protocols
        while data and not transport.is_closing():
            buf = memoryview(proto.get_buffer(len(data)))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            proto.buffer_updated(n)  # type: ignore[attr-defined]
            data = data[n:]
    elif isinstance(proto, asyncio.Protocol):
        proto.data_received(data)
