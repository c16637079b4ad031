"""Tying a child process's life to the process that started it."""

from __future__ import annotations

import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for Popen: the kernel sends SIGTERM to the child when its parent dies.

    A test run killed hard must not leave agents and engines behind on a shared machine. Linux
    only; elsewhere it does nothing and teardown is the only cleanup.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
