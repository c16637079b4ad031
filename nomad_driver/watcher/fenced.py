"""Model states written only under the leader's lock (a Consul transaction that checks the
session still holds it), and remembered until the KV snapshot shows them, so a pass does not redo
what the last one wrote."""

from __future__ import annotations

import dataclasses
import logging
import time

from nomad_driver.consul import Consul
from nomad_driver.state import LEADER_KEY, MalformedState, ModelState, parse_state, state_key
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.leader import Leadership

log = logging.getLogger("llmgw.watcher")

# A written state the KV snapshot has not shown for this long is not waited for any more: the key
# was deleted since, or Consul's indexes went back (a restored snapshot), and the KV is the truth.
PENDING_FOR_S = 60.0


class FencedStates:
    def __init__(self, consul: Consul, leadership: Leadership) -> None:
        self.consul = consul
        self.leadership = leadership
        # States written that the KV snapshot may not show yet: model -> (ModifyIndex, state,
        # when written, monotonic).
        self._written: dict[str, tuple[int, ModelState, float]] = {}

    def pending(self, model: str) -> tuple[int, ModelState] | None:
        written = self._written.get(model)
        return (written[0], written[1]) if written is not None else None

    def settle(self, kv_index: int, now: float | None = None) -> None:
        """Forget what the KV snapshot (at `kv_index`, the index of the whole prefix) already
        covers, whatever it says of the key, and what it has not shown for PENDING_FOR_S."""
        now = time.monotonic() if now is None else now
        self._written = {
            model: w for model, w in self._written.items() if w[0] > kv_index and now - w[2] < PENDING_FOR_S
        }

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
            self._written[model] = (result.indexes.get(key, cas + 1), state, time.monotonic())
            return True
        if result.failed_session_check():
            log.warning("event=fenced_write_refused model=%s reason=%r", model, result.errors)
            # Stop acting now (and count the loss); the election loop catches up with a new
            # session. The old one is destroyed, not left to hold anything until its TTL.
            self.leadership.step_down("a fenced write was refused: the lock is lost")
        else:
            log.info("event=state_conflict model=%s key=%s", model, key)
        return False


async def with_stored_state(consul: Consul, view: ModelView) -> ModelView:
    """`view` with the model's state as Consul holds it now (an admin operation's read)."""
    key = state_key(view.model.name)
    _, entries = await consul.kv_get(key)
    if not entries:
        return dataclasses.replace(view, state=None, state_index=0)
    try:
        state: ModelState | None = parse_state(key, entries[0].value)
    except MalformedState:
        state = None  # replaced whole, as a pass replaces it
    return dataclasses.replace(view, state=state, state_index=entries[0].modify_index)
