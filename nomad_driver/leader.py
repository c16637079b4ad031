"""One watcher leads: whoever holds `llmgw/leader` through a live Consul session.

Only the leader calls Nomad or writes state; the others serve the admin API read-only and point
at the leader. Leading is given up the moment the session cannot be renewed or the key names
someone else: a leader that only thinks it leads would scale jobs against the real one's
decisions. Its KV writes are also fenced (see `Consul.fenced_put`), so even one that has not
noticed yet cannot overwrite state.

Failover after a crash takes the session's TTL (Consul reaps late, up to twice the TTL) plus the
lock delay; a watcher that stops cleanly releases the lock at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from nomad_driver.blocking import backoff_delay
from nomad_driver.consul import Consul, ConsulError
from nomad_driver.state import LEADER_KEY

log = logging.getLogger("llmgw.leader")


@dataclass(frozen=True)
class LeaderInfo:
    id: str
    address: str

    def describe(self) -> str:
        return f"{self.id} at {self.address}" if self.address else self.id


def parse_leader(raw: bytes) -> LeaderInfo | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return LeaderInfo(str(data.get("id", "")), str(data.get("address", "")))


class Leadership:
    """Runs the election in the background; `is_leader` and `session` are safe to read any time."""

    def __init__(
        self,
        consul: Consul,
        *,
        address: str,
        ident: str | None = None,
        ttl_s: int = 10,
        lock_delay_s: float = 1.0,
        key: str = LEADER_KEY,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.consul = consul
        self.me = LeaderInfo(ident or f"watcher-{uuid.uuid4().hex[:8]}", address)
        self.ttl_s = ttl_s
        self.lock_delay_s = lock_delay_s
        self.key = key
        self.on_change = on_change
        self.session = ""
        self.is_leader = False
        self.leader: LeaderInfo | None = None
        self._last_renew = 0.0
        self._stopping = False

    def _set_leader(self, leading: bool, why: str) -> None:
        if leading == self.is_leader:
            return
        self.is_leader = leading
        if leading:
            self.leader = self.me
            log.info("event=leader_acquired id=%s address=%s", self.me.id, self.me.address)
        else:
            log.warning("event=leader_lost id=%s reason=%r", self.me.id, why)
        if self.on_change:
            self.on_change(leading)

    async def run(self) -> None:
        index = 0
        failures = 0
        while not self._stopping:
            try:
                index = await self._step(index)
                failures = 0
            except (ConsulError, ValueError) as exc:
                # A leader that cannot reach Consul cannot know it still leads: step down now.
                self._set_leader(False, f"consul unavailable: {exc}")
                if "invalid session" in str(exc):
                    self.session = ""  # Consul forgot it (a restart): make a new one
                if failures == 0:
                    log.warning("event=consul_unavailable component=leader error=%r", str(exc))
                failures += 1
                index = 0
                await asyncio.sleep(backoff_delay(failures, base=0.5, cap=5.0))

    async def _step(self, index: int) -> int:
        if not self.session:
            self.session = await self.consul.session_create(
                f"llmgw-watcher {self.me.id}", ttl_s=self.ttl_s, lock_delay_s=self.lock_delay_s
            )
            self._last_renew = time.monotonic()
        elif time.monotonic() - self._last_renew >= self.ttl_s / 3:
            if not await self.consul.session_renew(self.session):
                self.session = ""
                self._set_leader(False, "session expired")
                return 0
            self._last_renew = time.monotonic()

        # Look first, without blocking, so a free lock is taken at once.
        new_index, entries = await self.consul.kv_get(self.key, index=index, wait_s=self._wait())
        holder = entries[0].session if entries else ""
        if entries:
            self.leader = parse_leader(entries[0].value)
        if self.is_leader and holder != self.session:
            self._set_leader(False, f"lock held by session {holder or 'nobody'}")
        if not holder and not self._stopping:
            body = json.dumps({"id": self.me.id, "address": self.me.address}).encode()
            if await self.consul.kv_put(self.key, body, acquire=self.session):
                self.leader = self.me
                self._set_leader(True, "acquired")
                return 0  # read again at once to see our own lock
            # Refused: lock delay after a holder died, or another watcher was quicker.
            await asyncio.sleep(min(self.lock_delay_s, 1.0) or 0.2)
            return 0
        if holder and holder == self.session:
            self._set_leader(True, "holding")
        return new_index

    def _wait(self) -> float:
        # Short enough that the session is renewed well inside its TTL.
        return max(1.0, self.ttl_s / 3)

    async def resign(self) -> None:
        """Give the lock up at once (clean shutdown), so another watcher need not wait the TTL."""
        self._stopping = True
        was = self.is_leader
        self._set_leader(False, "shutting down")
        if self.session:
            try:
                if was:
                    await self.consul.kv_put(self.key, b"", release=self.session)
                await self.consul.session_destroy(self.session)
            except ConsulError as exc:
                log.warning("event=resign_failed error=%r", str(exc))
            self.session = ""
