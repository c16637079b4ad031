"""One watcher leads: whoever holds `llmgw/leader` through a live Consul session.

Only the leader calls Nomad or writes state; the others serve the admin API read-only and point
at the leader. Leading is given up the moment the session cannot be renewed or the key names
someone else: a leader that only thinks it leads would scale jobs against the real one's
decisions. Its KV writes are also fenced (see `Consul.fenced_put`), so even one that has not
noticed yet cannot overwrite state.

Leading also has a local deadline, the lease: the last successful renewal plus the TTL, less a
margin. Consul invalidates a session no sooner than its TTL after the last renewal it saw, and
that renewal was sent no earlier than the moment the lease counts from, so a leader cut off from
Consul stops calling Nomad while its session may still be alive, before another watcher can hold
the lock. The session is renewed on its own schedule, not between reads of the lock, so a slow
or hanging read never eats the lease; the watcher checks the lease right before each Nomad call.

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
from nomad_driver.safeload import LoadError, json_loads
from nomad_driver.state import LEADER_KEY

log = logging.getLogger("llmgw.leader")


class LeaseLost(Exception):
    """This watcher may no longer act as leader: its lease ran out or the lock was lost."""


@dataclass(frozen=True)
class LeaderInfo:
    id: str
    address: str

    def describe(self) -> str:
        return f"{self.id} at {self.address}" if self.address else self.id


# A leader's value is a few dozen bytes; anything much larger is not ours.
MAX_LEADER_VALUE = 4096


def parse_leader(raw: bytes) -> LeaderInfo | None:
    """Who leads, from the lock's value; None for anything that is not what a watcher writes
    (garbage, a huge or deeply nested value): shown as "no leader known", never a crash of the
    election, which would leave nobody leading."""
    try:
        data = json_loads(raw, f"consul:{LEADER_KEY}", max_bytes=MAX_LEADER_VALUE)
    except LoadError:
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
        lease_margin_s: float | None = None,
    ) -> None:
        self.consul = consul
        self.me = LeaderInfo(ident or f"watcher-{uuid.uuid4().hex[:8]}", address)
        self.ttl_s = ttl_s
        self.lock_delay_s = lock_delay_s
        self.key = key
        self.on_change = on_change
        # Room for a Nomad call that starts just inside the lease to finish before the TTL.
        self.lease_margin_s = lease_margin_s if lease_margin_s is not None else max(1.0, ttl_s / 5)
        self.session = ""
        self._leading = False
        self.leader: LeaderInfo | None = None
        # Monotonic time until which this watcher may act as leader.
        self.lease_until = 0.0
        self._stopping = False
        self._renewer: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()

    @property
    def is_leader(self) -> bool:
        """Holding the lock, as far as the last read showed, and inside the lease."""
        return self._leading and time.monotonic() < self.lease_until

    def check_lease(self, what: str) -> None:
        """Right before a Nomad call: refuse it unless this watcher leads inside its lease."""
        if not self.is_leader:
            raise LeaseLost(f"not leading (or the lease ran out) before {what}")

    def lease_left(self) -> float:
        return max(0.0, self.lease_until - time.monotonic()) if self._leading else 0.0

    def _lease_from(self, sent_at: float) -> None:
        self.lease_until = sent_at + self.ttl_s - self.lease_margin_s

    def _set_leader(self, leading: bool, why: str) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        if leading:
            self.leader = self.me
            log.info("event=leader_acquired id=%s address=%s", self.me.id, self.me.address)
        else:
            log.warning("event=leader_lost id=%s reason=%r", self.me.id, why)
        if self.on_change:
            self.on_change(leading)

    def step_down(self, why: str) -> None:
        """Stop leading at once (a fenced write was refused): the session is destroyed rather
        than left holding anything until its TTL, and the election loop makes a new one."""
        self._set_leader(False, why)
        self.abandon_session()

    async def run(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop())
        try:
            await self._elect()
        finally:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)

    async def _elect(self) -> None:
        index = 0
        failures = 0
        while not self._stopping:
            try:
                index = await self._step(index)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A leader that cannot read the lock cannot know it still leads: step down now.
                # Anything else that goes wrong here must not end the election either: a dead
                # election loop leaves no leader until the watcher is restarted.
                self._set_leader(False, f"consul unavailable: {exc}")
                if isinstance(exc, ConsulError):
                    await self._forget_session_if_gone()
                if failures == 0:
                    if isinstance(exc, ConsulError):
                        log.warning("event=consul_unavailable component=leader error=%r", str(exc))
                    else:
                        log.exception("event=election_failed error=%r", str(exc))
                failures += 1
                index = 0
                await asyncio.sleep(backoff_delay(failures, base=0.5, cap=5.0))

    async def _forget_session_if_gone(self) -> None:
        """After a failed step: if Consul no longer knows our session (its agent restarted, or
        someone destroyed it), forget it, so the next step makes a new one instead of asking
        for the lock with a dead one until the renewals notice. Told by the renewal's 404, the
        one answer Consul gives for a missing session; the failed call's own answer is only a
        500 whose text says "invalid session", and text is no signal (see `TxnResult`)."""
        session = self.session
        if not session:
            return
        try:
            async with asyncio.timeout(max(0.5, self.ttl_s / 3)):
                alive = await self.consul.session_renew(session)
        except (ConsulError, TimeoutError):
            return  # Consul itself is down: nothing learned about the session
        if not alive and self.session == session:
            self.session = ""

    async def _renew_loop(self) -> None:
        """Renew every third of the TTL, each renewal bounded by what is left of the lease: a
        renewal that cannot finish inside the lease is a lost lease, whatever Consul says later."""
        delay = self.ttl_s / 3
        while not self._stopping:
            await asyncio.sleep(delay)
            delay = self.ttl_s / 3
            session = self.session
            if not session:
                continue
            sent_at = time.monotonic()
            budget = self.lease_left() if self._leading else self.ttl_s / 3
            try:
                async with asyncio.timeout(max(0.5, budget)):
                    alive = await self.consul.session_renew(session)
            except (ConsulError, TimeoutError) as exc:
                if self._leading and time.monotonic() >= self.lease_until:
                    self._set_leader(False, f"lease expired: could not renew the session ({exc!r})")
                delay = 1.0  # try again soon: the lease is running out
                continue
            if session != self.session:
                continue
            if not alive:
                self._set_leader(False, "session expired")
                self.session = ""
                continue
            self._lease_from(sent_at)

    def abandon_session(self) -> None:
        """Forget the session and destroy it in the background, so it holds nothing (no lock,
        no lock delay) while Consul would otherwise keep it until its TTL runs out."""
        old, self.session = self.session, ""
        if old:
            task = asyncio.get_running_loop().create_task(self._destroy(old))
            self._destroying.add(task)
            task.add_done_callback(self._destroying.discard)

    async def _destroy(self, session: str) -> None:
        try:
            await self.consul.session_destroy(session)
        except ConsulError as exc:
            log.warning("event=session_destroy_failed session=%s error=%r", session, str(exc))

    async def _step(self, index: int) -> int:
        if not self.session:
            sent_at = time.monotonic()
            self.session = await self.consul.session_create(
                f"llmgw-watcher {self.me.id}", ttl_s=self.ttl_s, lock_delay_s=self.lock_delay_s
            )
            self._lease_from(sent_at)

        # Look first, without blocking, so a free lock is taken at once.
        new_index, entries = await self.consul.kv_get(self.key, index=index, wait_s=self._wait())
        holder = entries[0].session if entries else ""
        if entries:
            self.leader = parse_leader(entries[0].value) if holder else None
        if self._leading and holder != self.session:
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
        # Short enough that a lock taken over by someone else is noticed within a few seconds.
        return max(1.0, self.ttl_s / 3)

    async def resign(self) -> None:
        """Give the lock up at once (clean shutdown), so another watcher need not wait the TTL."""
        self._stopping = True
        was = self._leading
        self._set_leader(False, "shutting down")
        if self.session:
            try:
                if was:
                    await self.consul.kv_put(self.key, b"", release=self.session)
                await self.consul.session_destroy(self.session)
            except ConsulError as exc:
                log.warning("event=resign_failed error=%r", str(exc))
            self.session = ""
