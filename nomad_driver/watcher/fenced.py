"""Model states written only under the leader's lock (a Consul transaction that checks the
session still holds it), and remembered until the KV snapshot shows them, so a pass does not redo
what the last one wrote."""

from __future__ import annotations

import logging

from nomad_driver.consul import Consul
from nomad_driver.state import LEADER_KEY, ModelState, state_key
from nomad_driver.watcher.leader import Leadership

log = logging.getLogger("llmgw.watcher")


class FencedStates:
    def __init__(self, consul: Consul, leadership: Leadership) -> None:
        self.consul = consul
        self.leadership = leadership
        # States written that the KV snapshot may not show yet: model -> (ModifyIndex, state).
        self._written: dict[str, tuple[int, ModelState]] = {}

    def pending(self, model: str) -> tuple[int, ModelState] | None:
        return self._written.get(model)

    def forget(self) -> None:
        """On a change of leader: a new leader reads the KV before writing, a deposed one
        must not trust what it wrote."""
        self._written.clear()

    async def write(self, model: str, state: ModelState, cas: int) -> bool:
        session = self.leadership.session
        if not session or not self.leadership.is_leader:
            return False
        key = state_key(model)
        result = await self.consul.fenced_put(
            key, state.touched().to_kv(), cas=cas, session=session, lock_key=LEADER_KEY
        )
        if result.ok:
            # Remember it until the KV snapshot catches up, so the next pass does not redo it.
            self._written[model] = (result.indexes.get(key, cas + 1), state)
            return True
        if result.failed_session_check():
            log.warning("event=fenced_write_refused model=%s reason=%r", model, result.errors)
            # Stop acting now (and count the loss); the election loop catches up with a new
            # session. The old one is destroyed, not left to hold anything until its TTL.
            self.leadership.step_down("a fenced write was refused: the lock is lost")
        else:
            log.info("event=state_conflict model=%s key=%s", model, key)
        return False
