"""The connections to replicas: aiohttp sessions, connections bounded per replica, and the
rule for when a request may go out again.

A request is sent again only when the engine provably did not see it: the connection could not
be opened (refused, timed out connecting). Once any byte of the request went out, a connection
that closes without an answer is final (`RequestLost`): the engine may have acted on it, and a
prompt that crashes its engine, sent again, crashes the next replica too.

So a connection is kept for the next request only to an engine that keeps it open itself
(`keeps_connections`; each engine's module says why it does or does not). A request written on
a connection the engine is closing is read and dropped: lost, and not to be sent again. An
engine that does not keep connections gets one per request, which costs a fraction of a
millisecond beside a completion. Those that do (uvicorn's) keep one until it has been idle 5 s,
and the router stops reusing one well before that, so it is never written to as the engine
closes it. A replica whose engine the router does not know (no definition) gets a connection
per request too.
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from nomad_driver import engines
from router.config import Limits, Timeouts
from router.proxy import Held

UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
# A pooled connection idle this long is closed rather than reused: under the engines' 5 s, with
# room for a slow loop, so the router never writes into a connection the engine is closing.
IDLE_REUSE_S = 2.0


def keeps_connections(engine: str | None) -> bool:
    """Whether a connection to a replica of `engine` may carry more than one request."""
    known = engines.find(engine)
    return known is not None and known.keeps_connections


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


class Upstream:
    def __init__(self, timeouts: Timeouts, limits: Limits = Limits()) -> None:
        self.timeouts = timeouts
        self.limits = limits
        self.held = Held()
        self._pooled: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
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
        self._pooled = self._new_session(
            aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self.limits.max_per_replica,
                keepalive_timeout=IDLE_REUSE_S,
                ttl_dns_cache=300,
            )
        )
        self._fresh = self._new_session(
            aiohttp.TCPConnector(
                limit=0, limit_per_host=self.limits.max_per_replica, force_close=True, ttl_dns_cache=300
            )
        )

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._request_timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        for session in (self._pooled, self._fresh):
            if session is not None:
                await session.close()
        self._pooled = self._fresh = None

    async def open(self, url: URL, body: bytes, *, reuse: bool = False) -> aiohttp.ClientResponse:
        """POST `body` to `url`, on a pooled connection when `reuse` (see keeps_connections)."""
        session = self._pooled if reuse else self._fresh
        assert session is not None, "upstream session not started"
        try:
            return await session.post(url, data=body, headers=UPSTREAM_HEADERS)
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
