"""The watcher's `llmgw/` KV, read as four blocking queries, one per prefix it decides from.

Consul answers a prefix whole, whatever changed in it. Read as one, every write anywhere under
`llmgw/` (a state the leader wrote, a router's activity) read back every definition, state and
record of the fleet: at ten thousand models, tens of milliseconds of decoding per write. Per
prefix, a write costs a read of its own prefix only, and a router's ask (`llmgw/inflight/`, one
small key per router) is read without waiting behind the fleet's states:

- `llmgw/config/`: the definitions (`config_kv.py`);
- `llmgw/state/`: each model's state, written by the leader;
- `llmgw/activity/`: when each model was last asked for, written by the routers;
- `llmgw/inflight/`: each router's requests in flight and asks. A request waits on this read,
  so its token bucket allows more reads a second: the keys are one per router.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from nomad_driver.blocking import RATE_PER_S, Reading, Watch
from nomad_driver.config_kv import CONFIG_PREFIX
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.state import ACTIVITY_PREFIX, INFLIGHT_PREFIX, STATE_PREFIX
from nomad_driver.watcher.readings import KVParts
from nomad_driver.watcher.watch import kv_fetch

# A router's ask is read within this long of the last read at most, however fast asks come.
ROUTERS_RATE_PER_S = 50.0

PREFIXES = (CONFIG_PREFIX, STATE_PREFIX, ACTIVITY_PREFIX, INFLIGHT_PREFIX)


class KVWatches:
    def __init__(self, consul: Consul, wait_s: float, on_change: Callable[[str], None]) -> None:
        def watch(name: str, prefix: str, rate: float = RATE_PER_S) -> Watch[dict[str, KVEntry]]:
            return Watch(
                name, kv_fetch(consul, prefix, wait_s), on_change=partial(on_change, name), rate=rate
            )

        self.config = watch("consul-kv-config", CONFIG_PREFIX)
        self.states = watch("consul-kv-states", STATE_PREFIX)
        self.activity = watch("consul-kv-activity", ACTIVITY_PREFIX)
        self.routers = watch("consul-kv-routers", INFLIGHT_PREFIX, ROUTERS_RATE_PER_S)
        self.watches = (self.config, self.states, self.activity, self.routers)
        self._merged: tuple[tuple[object, ...], Reading[Mapping[str, KVEntry]]] | None = None

    def data(self, watch: Watch[dict[str, KVEntry]]) -> dict[str, KVEntry]:
        return watch.snapshot.data if watch.snapshot is not None else {}

    def parts(self) -> KVParts:
        """The latest reading of each prefix ({} and no index before its first)."""
        config, states = self.config.snapshot, self.states.snapshot
        return KVParts(
            self.data(self.config),
            config.index if config is not None else None,
            self.data(self.states),
            states.index if states is not None else None,
            self.data(self.activity),
            self.data(self.routers),
        )

    @property
    def snapshot(self) -> Reading[Mapping[str, KVEntry]] | None:
        """All four as one reading (None until each was read once): a view over them, not a copy."""
        readings = tuple(w.snapshot for w in self.watches)
        if any(r is None for r in readings):
            return None
        if self._merged is None or self._merged[0] != tuple(map(id, readings)):
            maps = [r.data for r in readings if r is not None]
            index = max(r.index for r in readings if r is not None)
            taken = min(r.taken_at for r in readings if r is not None)
            self._merged = (tuple(map(id, readings)), Reading(index, ChainMap(*maps), taken))
        return self._merged[1]

    @snapshot.setter
    def snapshot(self, reading: Reading[Mapping[str, KVEntry]]) -> None:
        """Set all four from one reading of `llmgw/` (a reading made by hand, in tests and the
        benchmark's synthetic mode), each keeping its own prefix."""
        for w, prefix in zip(self.watches, PREFIXES, strict=True):
            part = {k: e for k, e in reading.data.items() if k.startswith(prefix)}
            held = w.snapshot
            if held is None or held.data != part:
                w.snapshot = Reading(reading.index, part, reading.taken_at)

    @property
    def ok(self) -> bool:
        return all(w.ok for w in self.watches)

    @property
    def calls(self) -> int:
        return sum(w.calls for w in self.watches)

    def runs(self) -> list[Any]:
        return [w.run() for w in self.watches]
