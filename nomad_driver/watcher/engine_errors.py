"""The engine's own words for a failed start: the telling line of its stderr, read through
Nomad's logs API once per failed start, so a parked model names why it died, and a decision
given the most telling last error it can have."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import replace

from nomad_driver.nomad import Nomad, NomadError
from nomad_driver.redaction import redact
from nomad_driver.watcher import parking
from nomad_driver.watcher.decisions import Action, Decision, ModelView, Park, WriteState
from nomad_driver.watcher.health_text import model_health
from nomad_driver.watcher.reconcile import same_state

log = logging.getLogger("llmgw.watcher")

# (alloc, task, failures): one failed start.
StartKey = tuple[str, str, int]


class EngineErrors:
    def __init__(self, nomad: Nomad, wait_s: float) -> None:
        self.nomad = nomad
        # How long a read may wait for the stderr before falling back to Nomad's task event.
        self.wait_s = wait_s
        self._read: dict[StartKey, str] = {}

    def keep_only(self, starts: Iterable[StartKey]) -> None:
        """Forget the starts no decision parks any more."""
        wanted = set(starts)
        self._read = {k: v for k, v in self._read.items() if k in wanted}

    async def read(self, park: Park) -> str:
        """The line of the failed engine's stderr that says why it died; Nomad's task event
        only when that read fails or the engine wrote nothing telling. Bounded, because a pass
        waits for it."""
        error = await self.read_start(park.model, park.alloc_id, park.task, park.failures, park.event_error)
        if park.cause:
            # A multi-node replica's shard failed: alloc_id/task are that shard's, and the
            # error says which shard on which node, so nobody reads the leader's log for it.
            error = f"{park.cause}: {error}"
        return error

    async def read_start(self, model: str, alloc_id: str, task: str, failures: int, event_error: str) -> str:
        """`read` for any failed start: a parked model's, or a degraded one's failing slot."""
        key = (alloc_id, task, failures)
        if key in self._read:
            return self._read[key]
        line = ""
        if alloc_id and task:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.wait_s
            # An empty log is asked again only briefly: most engines that die write nothing
            # more, and parking must not wait seconds for them.
            patience = loop.time() + 0.5
            while True:
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns a read that
                    # finished as a cancel came and loses the cancel, and Watcher.stop() then
                    # waited on this pass forever.
                    async with asyncio.timeout(max(0.1, deadline - loop.time())):
                        stderr = await asyncio.to_thread(self.nomad.stderr_tail, alloc_id, task)
                except (NomadError, TimeoutError) as exc:
                    log.warning(
                        "event=stderr_unavailable model=%s alloc=%s error=%r fallback=task_event",
                        model,
                        alloc_id,
                        str(exc) or type(exc).__name__,
                    )
                    break
                line = parking.telling_line(stderr)
                # Nothing written yet can be a log shipper a moment behind the exit; an engine
                # that wrote and said nothing telling will not say more.
                if line or stderr.strip() or loop.time() + 0.1 >= min(deadline, patience):
                    break
                await asyncio.sleep(0.1)
        # What is stored, shown in the Consul UI and given to Nomad as the scaling message: an
        # engine's error quotes what it was given, a source or a token.
        error = redact(line or event_error) or "no error recorded"
        self._read[key] = error
        return error

    async def telling(self, d: Decision, view: ModelView) -> Decision:
        """The decision with the most telling last error it can have.

        A model about to be parked carries the engine's own words (its stderr) from the first
        moment anything shows it parked: the admin API, the metrics, the Consul UI and the state
        in KV, on every watcher. And a telling error already stored is never replaced by a less
        telling one ("Exit Code: 1") for the same run of failures.
        """
        state = d.state
        stored = view.state
        park = next((a for a in d.actions if isinstance(a, Park)), None)
        if d.degraded is not None and d.degraded.slots:
            # The failing slot beside the serving replicas, named with the engine's words.
            slot = d.degraded.slots[0]
            words = await self.read_start(d.model, slot.alloc_id, slot.task, slot.failures, slot.error)
            state = state.model_copy(update={"degraded": d.degraded.text(d.model, words)})
            if same_state(state, d.state):
                return d
        elif park is not None:
            state = state.model_copy(update={"last_error": await self.read(park)})
        elif (
            stored is not None
            and state.last_error != stored.last_error
            and parking.telling_line(stored.last_error)
            and not parking.telling_line(state.last_error)
            and state.consecutive_failures >= stored.consecutive_failures > 0
        ):
            state = state.model_copy(update={"last_error": stored.last_error})
        else:
            return d
        health, output = model_health(d.model, state, d.desired, d.ready, d.starting, d.desired_detail)
        actions: list[Action] = []
        for a in d.actions:
            if isinstance(a, Park):
                a = replace(a, state=state)
            elif isinstance(a, WriteState):
                unchanged = stored is not None and not view.state_problem and same_state(state, stored)
                if unchanged:
                    continue
                a = replace(a, state=state)
            actions.append(a)
        writes = any(isinstance(a, (Park, WriteState)) for a in actions)
        if not writes and (stored is None or view.state_problem or not same_state(state, stored)):
            actions.append(WriteState(d.model, state, view.state_index))
        return replace(d, state=state, health=health, health_output=output, actions=tuple(actions))
