"""How a fetch fails: one exit code per cause, and a cause in plain words.

The watcher reads the last line the fetch task wrote to stderr (`fetch failed: <cause>`) and
names it as a fetch failure, never an engine crash (watcher/engine_errors.py). The exit codes
let a script tell the causes apart without parsing words.
"""

from __future__ import annotations

FAILED_PREFIX = "fetch failed: "


class FetchError(Exception):
    exit_code = 1
    cause = "failed"

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail

    def line(self) -> str:
        """The one line the fetch writes last to stderr."""
        return FAILED_PREFIX + self.cause + (f" ({self.detail})" if self.detail else "")


class CredentialsRefused(FetchError):
    exit_code = 10
    cause = "credentials refused"


class NotFound(FetchError):
    exit_code = 11
    cause = "not found"


class NoSpace(FetchError):
    exit_code = 12
    cause = "no space"


class Unreachable(FetchError):
    exit_code = 13
    cause = "source unreachable"


class TooSlow(FetchError):
    exit_code = 14

    def __init__(self, min_rate: float, window_s: float, detail: str = "") -> None:
        super().__init__(detail)
        self.cause = f"too slow: under {int(min_rate)} B/s for {int(window_s)} s"


class Corrupt(FetchError):
    exit_code = 15
    cause = "verification failed"
