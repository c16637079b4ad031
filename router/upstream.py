"""The connections to replicas: one aiohttp session, a keep-alive pool bounded per replica, and
the rule for when a request may go out again.

A request is sent again only when the engine provably did not see it. Two cases qualify: the
connection could not be opened (refused, timed out connecting), and a pooled connection that
the engine had already closed while it sat idle, which is found before anything is written to it
(`ProbingConnector`) and replaced by a new one. Once any byte of the request went out, a
connection that closes without an answer is final (`RequestLost`): the engine may have acted on
it, and a prompt that crashes its engine, sent again, crashes the next replica too.
"""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
from yarl import URL

from router.config import Limits, Timeouts
from router.proxy import Held

UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


class ConnectFailed(Exception):
    """No connection to the replica: it has not seen the request, so another one may take it."""


class UpstreamTimeout(Exception):
    """The replica accepted the request but said nothing within the first-byte timeout."""


class RequestLost(Exception):
    """The request went out and the replica closed the connection, or answered something that
    is not HTTP; `code` says which."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def still_open(transport: Any) -> bool:
    """Whether a pooled connection can take a request: the engine has not closed it (a FIN
    waiting to be read) or written anything unasked. One non-blocking peek, no bytes taken."""
    if transport is None or transport.is_closing():
        return False
    sock = transport.get_extra_info("socket")
    if sock is None:
        return True
    probe = socket.socket(fileno=sock.fileno())
    try:
        probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        probe.detach()
    # b"" is the engine's close; bytes before a request are an answer to nothing.
    return False


class ProbingConnector(aiohttp.TCPConnector):
    """aiohttp's connector, which takes a pooled connection as alive until its close has been
    read by the event loop; this one looks at the socket first. An engine that closed an idle
    connection a moment ago (llama-server at its keep-alive, or when its HTTP threads are all
    taken) then costs a new connection, not a request written into a closed socket.

    `_get` is aiohttp's private method (3.10 to 3.14 have this signature);
    tests/router/test_pinned_internals.py fails when it moves."""

    async def _get(self, key: Any, traces: list[Any]) -> Any:
        while True:
            conn = await super()._get(key, traces)
            if conn is None or still_open(conn.transport):
                return conn
            conn.close()


class Upstream:
    def __init__(self, timeouts: Timeouts, limits: Limits = Limits()) -> None:
        self.timeouts = timeouts
        self.limits = limits
        self.held = Held()
        self._session: aiohttp.ClientSession | None = None
        self._request_timeout = aiohttp.ClientTimeout(
            total=None,
            # The pool's own wait as well as connecting; the request path keeps requests per
            # replica under the pool's limit, so this is a backstop, never the rule.
            connect=timeouts.pool_wait_s + timeouts.connect_s,
            sock_connect=timeouts.connect_s,
            # Governs every socket read: the response head, a whole non-streamed body, and a
            # stream's first event; `between_chunks_s` tightens it once a stream flows.
            sock_read=timeouts.first_byte_s,
        )

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=ProbingConnector(
                limit=0,
                limit_per_host=self.limits.max_per_replica,
                # Engines keep idle connections for a while too (uvicorn: 5 s); closing ours
                # first avoids writing a request into a socket the engine is closing.
                keepalive_timeout=4.0,
                ttl_dns_cache=300,
            ),
            timeout=self._request_timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None

    async def open(self, url: URL, body: bytes) -> aiohttp.ClientResponse:
        assert self._session is not None, "upstream session not started"
        try:
            return await self._session.post(url, data=body, headers=UPSTREAM_HEADERS)
        except aiohttp.ConnectionTimeoutError as exc:
            raise ConnectFailed(f"connect timed out after {self.timeouts.connect_s:g}s") from exc
        except aiohttp.SocketTimeoutError as exc:
            raise UpstreamTimeout(f"no answer within {self.timeouts.first_byte_s:g}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise RequestLost(
                "upstream_closed",
                f"closed the connection after the request was sent, without answering ({type(exc).__name__})",
            ) from exc
        except aiohttp.ClientResponseError as exc:
            raise RequestLost(
                "upstream_invalid", f"answered something that is not HTTP: {exc.message}"
            ) from exc
        except aiohttp.ClientError as exc:
            raise RequestLost("upstream_closed", f"failed after the request was sent: {exc!r}") from exc
