"""The router leans on a private corner of uvicorn: the connection guard subclasses its httptools
protocol and repeats its `data_received` (router/server.py). pyproject.toml pins the versions it
was tested with; these tests fail when a version moves what it relies on, before the guard
silently stops guarding."""

from __future__ import annotations

import inspect
import textwrap
from importlib.metadata import version

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from tests.router.conftest import ROOT

UVICORN_DATA_RECEIVED = """
def data_received(self, data: bytes) -> None:
    self._unset_keepalive_if_required()

    try:
        self.parser.feed_data(data)
    except httptools.HttpParserError:
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)
        return
    except httptools.HttpParserUpgrade:
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        else:
            self._unsupported_upgrade_warning()
"""


def release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def pinned(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The `name>=LOW,<HIGH` range in pyproject.toml."""
    for line in (ROOT / "pyproject.toml").read_text().splitlines():
        stripped = line.strip().strip('",')
        if stripped.startswith(f"{name}>="):
            low, _, high = stripped[len(name) + 2 :].partition(",<")
            # An upper bound: a new minor version is tested before it is let in.
            assert high, f"{name} has no upper bound in pyproject.toml"
            return release(low), release(high)
    raise AssertionError(f"{name} is not in pyproject.toml")


def test_the_installed_uvicorn_is_in_the_pinned_range() -> None:
    for name in ("uvicorn",):
        low, high = pinned(name)
        assert low <= release(version(name)) < high, (name, version(name), low, high)


def test_uvicorns_httptools_protocol_still_has_what_the_guard_uses() -> None:
    own = textwrap.dedent(inspect.getsource(HttpToolsProtocol.data_received))
    assert own.strip() == UVICORN_DATA_RECEIVED.strip(), (
        "uvicorn's data_received changed: update GuardedProtocol"
    )
    for method in (
        "_unset_keepalive_if_required",
        "_should_upgrade",
        "handle_websocket_upgrade",
        "_unsupported_upgrade_warning",
        "send_400_response",
        "on_message_begin",
        "on_header",
        "on_headers_complete",
        "on_message_complete",
        "on_response_complete",
    ):
        assert callable(getattr(HttpToolsProtocol, method, None)), method
    init = inspect.getsource(HttpToolsProtocol.__init__)
    for attribute in ("self.pipeline", "self.cycle", "self.connections", "self.parser"):
        assert attribute in init, attribute
    # A pipelined request becomes the current cycle when its head is complete, and the guard's
    # "responding" is that cycle's response not being complete.
    assert "self.cycle = RequestResponseCycle(" in inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert "self.response_complete = False" in inspect.getsource(RequestResponseCycle.__init__)
