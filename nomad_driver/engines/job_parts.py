"""What every engine's task fits into, as `render.py` builds the job around it: the port labels
it listens on, the timing of the checks on it, how the shards of a multi-node replica find each
other in Consul, and how a word reaches /bin/sh unchanged."""

from __future__ import annotations

import re
from typing import Any

SECOND = 1_000_000_000

PORT_LABEL = "http"
# A multi-node replica's shards listen on this port, whatever their engine runs on it.
RPC_PORT_LABEL = "rpc"
SHARD_SERVICE = "llmgw-shard"

CHECK_INTERVAL = 5 * SECOND
CHECK_TIMEOUT = 2 * SECOND


def shard_tag(job_id: str) -> str:
    """The tag the shards of one replica carry; the leader's template looks up exactly these."""
    return f"job={job_id}"


def env_template(body: str, dest: str) -> dict[str, Any]:
    """A template whose lines become the task's environment, restarting the task when they
    change: how a leader learns its shards, or a shard its head."""
    return {
        "EmbeddedTmpl": body,
        "DestPath": dest,
        "Envvars": True,
        "ChangeMode": "restart",
        "Splay": 0,
    }


def tcp_check(name: str, port: str) -> dict[str, Any]:
    return {
        "Name": name,
        "Type": "tcp",
        "PortLabel": port,
        "Interval": CHECK_INTERVAL,
        "Timeout": CHECK_TIMEOUT,
    }


def shell_word(word: str) -> str:
    """One argument for /bin/sh; `${VAR}` is left for Nomad to interpolate before the shell runs."""
    if re.fullmatch(r"[A-Za-z0-9_./:=,@%+${}-]+", word):
        return word
    return "'" + word.replace("'", "'\\''") + "'"
