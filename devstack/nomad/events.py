"""The event stream (`nomad/stream/`, `nomad/state/events.go`): every commit's events, kept in
a short buffer so a subscriber can start from an index, fanned out to subscribers filtered by
topic and key, framed as NDJSON `{"Index": n, "Events": [...]}` with `{}` heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from devstack.nomad.state import Event, StateStore

Json = dict[str, Any]

TOPICS = ("Job", "Evaluation", "Allocation", "Node", "Deployment", "NodePool", "Service", "*")
# Nomad's event buffer defaults to 100 items; a few more commits are cheap here and let a test
# subscribe a little after the writes it wants to see.
BUFFER_SIZE = 2048
# A subscriber this far behind is dropped rather than allowed to grow without bound; Nomad
# closes lagging subscriptions the same way.
MAX_BACKLOG = 10_000


class TopicFilter:
    """`topic=Job:web` style filters; no filter at all means every topic."""

    def __init__(self, topics: dict[str, set[str]] | None = None) -> None:
        self.topics = topics or {"*": {"*"}}

    @classmethod
    def parse(cls, values: list[str]) -> TopicFilter:
        if not values:
            return cls()
        topics: dict[str, set[str]] = {}
        for value in values:
            topic, _, key = value.partition(":")
            if not topic:
                raise ValueError(f"Invalid topic query parameter: {value!r}")
            topics.setdefault(topic, set()).add(key or "*")
        return cls(topics)

    def matches(self, event: Json) -> bool:
        for topic in (event["Topic"], "*"):
            keys = self.topics.get(topic)
            if keys is None:
                continue
            if "*" in keys or event["Key"] in keys:
                return True
            if any(k in keys for k in event.get("FilterKeys") or ()):
                return True
        return False


def event_json(event: Event) -> Json:
    out = event.to_json()
    payload = event.payload
    if event.topic == "Evaluation":
        ev = payload.get("Evaluation") or {}
        out["FilterKeys"] = [ev.get("JobID", ""), ev.get("DeploymentID", "")]
    elif event.topic == "Allocation":
        alloc = payload.get("Allocation") or {}
        out["FilterKeys"] = [alloc.get("JobID", ""), alloc.get("DeploymentID", "")]
    return out


class EventBroker:
    """Reads the store's commits once and serves them to any number of stream subscribers."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._buffer: deque[tuple[int, list[Json]]] = deque(maxlen=BUFFER_SIZE)
        self._subscribers: set[asyncio.Queue[tuple[int, list[Json]] | None]] = set()
        self._source: asyncio.Queue[list[Event]] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._source = self._store.subscribe()
        self._task = asyncio.create_task(self._pump(), name="nomad-events")

    async def stop(self) -> None:
        if self._source is not None:
            self._store.unsubscribe(self._source)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for queue in list(self._subscribers):
            queue.put_nowait(None)

    async def _pump(self) -> None:
        assert self._source is not None
        while True:
            events = await self._source.get()
            if not events:
                continue
            item = (events[0].index, [event_json(e) for e in events])
            self._buffer.append(item)
            for queue in list(self._subscribers):
                if queue.qsize() >= MAX_BACKLOG:
                    self._subscribers.discard(queue)
                    queue.put_nowait(None)
                else:
                    queue.put_nowait(item)

    async def subscribe(
        self, index: int, topics: TopicFilter, namespace: str, heartbeat_s: float
    ) -> AsyncGenerator[Json, None]:
        """Frames for one subscriber: buffered commits at or after `index` (with index 0, the
        newest commit), then live ones; `{}` at once and whenever `heartbeat_s` passes without a
        frame."""
        queue: asyncio.Queue[tuple[int, list[Json]] | None] = asyncio.Queue()
        # Replay and registration happen without an await in between, so nothing falls in a gap.
        if index > 0:
            for buffered in self._buffer:
                if buffered[0] >= index:
                    queue.put_nowait(buffered)
        elif self._buffer:
            # Index 0 starts at the buffer's head, the newest commit (stream.EventBroker.Subscribe).
            queue.put_nowait(self._buffer[-1])
        self._subscribers.add(queue)
        loop = asyncio.get_running_loop()
        try:
            yield {}
            # Counted from the last frame sent, not the last commit seen: commits of topics this
            # subscriber does not follow send nothing, and a stream that only they kept busy
            # would go silent until the client's read timeout ended it.
            beat_at = loop.time() + heartbeat_s
            while True:
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can drop an item
                    # (or a cancel) that arrives just as the heartbeat timer fires.
                    async with asyncio.timeout_at(beat_at):
                        item = await queue.get()
                except TimeoutError:
                    yield {}
                    beat_at = loop.time() + heartbeat_s
                    continue
                if item is None:
                    return
                idx, events = item
                selected = [
                    e
                    for e in events
                    if topics.matches(e) and (namespace == "*" or e["Namespace"] in (namespace, ""))
                ]
                if selected:
                    yield {"Index": idx, "Events": selected}
                    beat_at = loop.time() + heartbeat_s
        finally:
            self._subscribers.discard(queue)
