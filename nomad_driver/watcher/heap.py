"""What the watcher holds between passes, kept out of the garbage collector's full walks.

At 10,000 models the watcher holds about 830,000 container objects between passes: Nomad's jobs
and allocations, Consul's engine entries and KV, the views and decisions (`bench/watcher_bench.py`
with a `gc.callbacks` hook, docs/dev/benchmarks.md). CPython's collector walks every one of them
at each full collection: 340-500 ms of CPU, about once a minute on a fleet where nothing changes,
which made an idle minute at 10,000 models cost 2.9 times the one at 1,000.

None of that needs the collector. It is decoded JSON and dataclasses, which reference counting
frees the moment a new reading replaces them; the full collections there found almost nothing
(0 to 30 objects each). So after each pass what is alive is frozen (`gc.freeze()`, a splice of
lists): later collections walk only what came since. What a frozen object keeps from being
collected is a garbage cycle it is part of; each full pass (at the start and every 30 minutes,
`marks.py`) unfreezes and collects, so such garbage waits one resync at most.

The process's own choice: `llmgw watcher` turns it on. A watcher built inside another program
(the test suite) shares that program's heap and leaves it alone.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("llmgw.watcher")


class HeldHeap:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.last_collected = 0  # what the last of them found unreachable

    def after_pass(self, full: bool) -> None:
        if not self.enabled:
            return
        if full:
            gc.unfreeze()
            started = time.process_time()
            self.last_collected = gc.collect()
            log.debug(
                "event=heap_collected unreachable=%d cpu_ms=%.0f",
                self.last_collected,
                (time.process_time() - started) * 1000,
            )
        gc.freeze()

    def release(self) -> None:
        """Hand every frozen object back to the collector (the watcher stopped)."""
        if self.enabled:
            gc.unfreeze()
