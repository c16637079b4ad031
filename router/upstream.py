"""The connections to replicas: one aiohttp session, connections bounded per replica, and the
rule for when a request may go out again.

A request is sent again only when the engine provably did not see it: the connection could not
be opened (refused, timed out connecting). Once any byte of the request went out, a connection
that closes without an answer is final (`RequestLost`): the engine may have acted on it, and a
prompt that crashes its engine, sent again, crashes the next replica too.

So each request has a connection of its own. llama-server was seen closing a kept-alive
connection 0.45 ms after a request went out on it, under a load burst, with no answer and no
crash: a request lost that the router may not send again (3 of 14 runs of the load-scaling
test; none of 6 with a connection per request, and none of 5 before the rule above, which sent
it again). Opening a connection costs a fraction of a millisecond on a cluster's network,
nothing beside a completion.
"""

from __future__ import annotations

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
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=self.limits.max_per_replica,
                # No keep-alive: a request on a connection the engine is closing is lost
                # (above).
                force_close=True,
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
