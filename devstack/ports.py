"""Free loopback ports for the processes the dev stack and the tests start."""

from __future__ import annotations

import os
import random
import socket
from contextlib import ExitStack

# Listeners of the dev world take ports from here: below Nomad's dynamic port range (20000-32000,
# which the stand-in hands its jobs) and the kernel's ephemeral range (32768 and up, which every
# outgoing connection takes from), so neither can take a port between our pick and our bind.
LISTEN_PORTS = (10000, 20000)


def worker_band(low: int, high: int) -> tuple[int, int]:
    """[low, high) narrowed to this test worker's share when pytest-xdist runs several: every
    process a worker starts inherits PYTEST_XDIST_WORKER (gw0, gw1, ...), so two workers' stacks
    never pick the same port. The whole range otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
        index = int(worker[2:]) if worker.startswith("gw") else 0
    except ValueError:
        return low, high
    if count <= 1 or not 0 <= index < count:
        return low, high
    span = (high - low) // count
    return low + index * span, low + (index + 1) * span


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago, from this worker's band of LISTEN_PORTS.

    Another process may still take it before ours binds, which is rare enough that callers
    simply start again on a new port if a bind fails.
    """
    low, high = worker_band(*LISTEN_PORTS)
    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: all held open together, so the kernel cannot hand one out twice."""
    if n < 0:
        raise ValueError(f"free_ports: n must be >= 0, got {n}")
    low, high = worker_band(*LISTEN_PORTS)
    with ExitStack() as stack:
        ports: list[int] = []
        for _ in range(100 * max(n, 1)):
            if len(ports) == n:
                break
            port = random.randrange(low, high)
            if port in ports:
                continue
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < n:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports
