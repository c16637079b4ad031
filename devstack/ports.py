"""Free loopback ports for the processes the dev stack and the tests start."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago.

    The kernel picks it; another process may still take it before ours binds, which is rare
    enough on loopback that callers simply start again on a new port if a bind fails.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: all held open together, so the kernel cannot hand one out twice."""
    if n < 0:
        raise ValueError(f"free_ports: n must be >= 0, got {n}")
    with ExitStack() as stack:
        ports: list[int] = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports
