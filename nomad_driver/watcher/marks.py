"""Which models the next pass reconciles: those a change touched, and those whose clock came due.

A pass costs what it reconciles. Each reading that changes (a job, an allocation, an
evaluation, an engine's check, a KV key, a router's record) marks the models it touches
(`readings.py` says which); each decision leaves the moment its clock next matters (`quiet.py`'s
deadlines: an idle timeout, the step interval, the load window, the scale-down delay), and the
model is marked when that moment comes. A pass takes the marks and reconciles those models only;
every other model's last decision stands, which is exactly what a pass over it would decide,
since `reconcile` is a pure function of the view and nothing in its view moved.

Everything is marked (a full pass) at the start, on a leadership change, after a pass that could
not do all it had to, after the catalog could not be set, and every `RESYNC_EVERY_S`: the safety
net for a change no reading told of. The feeds' own lists again (every 5 minutes, `feeds.py`)
mark every model when they find what the watcher held was wrong; this pass is for a change the
marks themselves would miss, and at ten thousand models costs seconds of CPU, so it is rare. The test suite runs every pass over every model and fails on any model whose decision came
out different from the one that stood (`quiet.py`'s check, `LLMGW_VERIFY_SKIPPED_PASSES`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping
from math import inf
from typing import Any

from nomad_driver.blocking import Watch
from nomad_driver.placement import PlacementWarnings
from nomad_driver.spec import Model
from nomad_driver.watcher.feeds import _Feed
from nomad_driver.watcher.kv_watches import KVWatches
from nomad_driver.watcher.readings import touched_models
from nomad_driver.watcher.replicas import node_fabrics
from nomad_driver.watcher.rollout import job_ids
from nomad_driver.watcher.views import ViewBuilder

RESYNC_EVERY_S = 1800.0
# A change that marks this many models at once is logged with its source.
WAVE = 100

log = logging.getLogger("llmgw.watcher")


class Marks:
    def __init__(self, full_every_s: float = RESYNC_EVERY_S) -> None:
        self.full_every_s = full_every_s
        self.everything = True
        self.models: set[str] = set()
        # When each model's decision next depends on the clock (absent: not while nothing
        # changes); a heap of the same, whose stale entries are dropped as they surface.
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self.full_at = -inf  # when the last full pass ran
        self.full_passes = 0
        self.model_passes = 0  # models reconciled, over all passes

    def all(self) -> None:
        self.everything = True

    def touch(self, models: Iterable[str]) -> None:
        self.models.update(models)

    def due_at(self, model: str, at: float) -> None:
        """`model`'s decision stands until `at` (-inf: reconcile it at the next pass; inf: as
        long as nothing changes)."""
        if at == -inf:
            self._due.pop(model, None)
            self.models.add(model)
        elif at == inf:
            self._due.pop(model, None)
        elif self._due.get(model) != at:
            self._due[model] = at
            heapq.heappush(self._heap, (at, model))

    def next_due(self) -> float:
        """The earliest moment a model's clock comes due (inf: none), full passes included."""
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)
        return min(self._heap[0][0] if self._heap else inf, self.full_at + self.full_every_s)

    def pending(self, now: float) -> bool:
        return self.everything or bool(self.models) or self.next_due() <= now

    def take(self, now: float) -> set[str] | None:
        """The models to reconcile now and forget the marks (None: every model)."""
        if now >= self.full_at + self.full_every_s:
            self.everything = True
        if self.everything:
            self.everything = False
            self.models = set()
            self._due.clear()
            self._heap = []
            self.full_at = now
            self.full_passes += 1
            return None
        while self._heap and self._heap[0][0] <= now:
            at, model = heapq.heappop(self._heap)
            if self._due.get(model) == at:
                del self._due[model]
                self.models.add(model)
        taken, self.models = self.models, set()
        return taken

    def give_back(self, models: set[str] | None) -> None:
        """A pass that could not finish: what it took is asked again."""
        if models is None:
            self.everything = True
        else:
            self.models |= models


class ChangeReader:
    """Turns each new reading of the watcher's watches into marks (`readings.py` says which
    models a change touches)."""

    def __init__(
        self,
        marks: Marks,
        memory: ViewBuilder,
        warnings: PlacementWarnings,
        kv: KVWatches,
        engines: Watch[tuple[dict[str, Any], ...]],
        nomad_watches: Mapping[str, Watch[Any]],
        nodes: Watch[tuple[dict[str, Any], ...]],
    ) -> None:
        self.marks = marks
        self.memory = memory
        self.warnings = warnings
        self.kv, self.engines, self.nomad_watches, self.nodes = kv, engines, nomad_watches, nodes
        self._hints: dict[str, tuple[object, set[str] | None]] = {}
        self._seen: dict[str, object] = {}
        self._defined: Mapping[str, Model] = {}
        self._job_models: dict[str, str] = {}
        self.multinode: tuple[str, ...] = ()
        self._node_fabrics: dict[str, str] | None = None

    def feed_read(self, name: str, feed: _Feed[Any]) -> None:
        """A feed's new reading, with the jobs its events named: taken as the reading is
        published, so the hint is never ahead of, or behind, what it describes."""
        hint = feed.take_changes()
        held = self._hints.get(name)
        if held is not None and hint is not None and held[1] is not None:
            hint = held[1] | hint
        elif held is not None:
            hint = None
        self._hints[name] = (self.nomad_watches[name].snapshot, hint)

    def nodes_read(self) -> bool:
        """A pass reads of the nodes only each one's fabric (the replica list) and, for a
        multi-node model, the room in each fabric; any other node change (another job placed,
        a heartbeat's fields) touches no other model, or it would cost a pass over every one.
        Read at the next tick's pass, not at once; whether it marked any."""
        fabrics = node_fabrics(self.nodes.snapshot.data if self.nodes.snapshot else ())
        if fabrics != self._node_fabrics:
            self._node_fabrics = fabrics
            self.marks.all()
            return True
        self.marks.touch(self.multinode)
        return bool(self.multinode)

    def read(self, now: float) -> bool:
        """Mark the models the readings changed since the last look; whether a pass has any
        model to reconcile now."""
        kv = self.kv.parts()
        readings = self.memory.readings
        definitions = self.memory.definitions
        if self.kv.config.snapshot is not None:
            definitions.load(kv.config, kv.config_index)
        self._mark("kv", readings.kv_touched(kv, now))
        if definitions.models is not self._defined:
            before, self._defined = self._defined, definitions.models
            changed = {n for n, m in self._defined.items() if before.get(n) is not m}
            self._mark("definitions", changed | (before.keys() - self._defined.keys()))
            self._job_models = {jid: n for n, m in self._defined.items() for jid in job_ids(m)}
            self.multinode = tuple(n for n, m in self._defined.items() if m.profile.nodes > 1)
        if self.engines.snapshot is not None:
            self._mark("engines", readings.engines_touched(self.engines.snapshot.data))
        for name, watch in self.nomad_watches.items():
            snapshot = watch.snapshot
            if snapshot is None or snapshot is self._seen.get(name):
                continue
            self._seen[name] = snapshot
            held = self._hints.pop(name, None)
            hint = held[1] if held is not None and held[0] is snapshot else None
            self._mark(name, touched_models(hint, self._job_models, self.multinode))
        self.marks.touch(self.warnings.due(now))
        return self.marks.pending(now)

    def _mark(self, source: str, models: set[str] | None) -> None:
        """Mark `models` (None: every model). A wave is logged with its source: a pass over
        thousands of models costs seconds of CPU, and this says what asked for it."""
        if models is None or len(models) >= WAVE:
            shown = "every model" if models is None else f"{len(models)} models, e.g. {min(models)}"
            log.info("event=marked_many source=%s models=%r", source, shown)
        self._touch(models)

    def _touch(self, models: set[str] | None) -> None:
        if models is None:
            self.marks.all()
        else:
            self.marks.touch(models)
