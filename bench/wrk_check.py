"""Pass-through throughput under a C load generator: `wrk` POSTing a chat completion with 64
connections (one thread, beside the targets on the same cores), against the bare ASGI +
aiohttp proxy and the router in front of the same stub, one after the other in one run.

wrk is Debian's (`make wrk` unpacks it under ~/.cache/llmgw/wrk, with the LuaJIT it links).
A C client costs the machine far less than Python clients, so the servers' own cost shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

WRK_ROOT = Path(os.environ.get("LLMGW_WRK_ROOT", Path.home() / ".cache" / "llmgw" / "wrk"))
WRK_LIB = WRK_ROOT / "usr" / "lib" / "x86_64-linux-gnu"


def available() -> bool:
    return (WRK_ROOT / "usr" / "bin" / "wrk").is_file()


def requests_per_second(
    url: str, body: bytes, *, connections: int = 64, seconds: float = 8.0
) -> tuple[float, int]:
    """wrk's Requests/sec for POST `body` to `url`, and its count of non-2xx answers and socket
    errors together."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write("wrk.body = [==[" + body.decode() + "]==]\n")
        lua = f.name
    try:
        done = subprocess.run(
            [
                str(WRK_ROOT / "usr" / "bin" / "wrk"),
                "-t1",
                f"-c{connections}",
                f"-d{seconds:g}s",
                "-s",
                lua,
                url,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "LD_LIBRARY_PATH": str(WRK_LIB)},
            timeout=seconds + 60,
        )
    finally:
        os.unlink(lua)
    out = done.stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if done.returncode != 0 or rate is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr or out}")
    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors:
        bad += sum(int(n) for n in errors.groups())
    return float(rate.group(1)), bad
