"""What an operator asks of the leading watcher through the admin API (`llmgw ctl retry`), and
the answers that are not a state: this watcher does not lead, or has no such model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from nomad_driver.consul import ConsulUnavailable
from nomad_driver.state import ModelState, state_key
from nomad_driver.watcher.counting import retried
from nomad_driver.watcher.fenced import with_stored_state
from nomad_driver.watcher.leader import LeaderInfo

if TYPE_CHECKING:
    from nomad_driver.watcher.loop import Watcher

log = logging.getLogger("llmgw.watcher")

# A retry whose check-and-set loses reads the key again: only a writer outside llmgw racing it
# three times running is told to try again.
RETRY_WRITE_ATTEMPTS = 3


class NotLeader(Exception):
    def __init__(self, leader: LeaderInfo | None) -> None:
        where = leader.describe() if leader else "no watcher leads right now"
        super().__init__(f"this watcher does not lead; the leader is {where}")
        self.leader = leader


class UnknownModel(KeyError):
    pass


async def retry_model(watcher: Watcher, model: str) -> ModelState:
    """Clear the model's count and unpark it; the next pass restores its replicas."""
    # Under the pass's lock and from the key as Consul holds it now: a pass's write in flight,
    # or a change the KV snapshot does not show yet, would otherwise fail the check-and-set and
    # tell the operator to try again for nothing.
    async with watcher._apply_lock:
        for _ in range(RETRY_WRITE_ATTEMPTS):
            if not watcher.leadership.is_leader:
                raise NotLeader(watcher.leadership.leader)
            views = watcher.build_views()
            if model not in views:
                raise UnknownModel(model)
            view = await with_stored_state(watcher.consul, views[model])
            state = retried(view)
            if await watcher.states.write(model, state, view.state_index):
                log.info("event=retried model=%s", model)
                # Decided from this write (`states.pending`): the read-back may come later.
                watcher.marks.touch((model,))
                watcher.wake("retry")
                return state
    raise ConsulUnavailable(f"could not write {state_key(model)}; try again")
