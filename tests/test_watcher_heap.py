"""What a pass leaves alive stays out of the collector's full walks (`watcher/heap.py`).

At 10,000 models a full collection walked the watcher's ~830,000 held objects, 340-500 ms of
CPU about once a minute on an idle fleet. These tests freeze this process's heap for a moment
and give it back before they end.
"""

from __future__ import annotations

import gc
import time
import weakref

from nomad_driver.watcher.heap import HeldHeap


def held_readings(n: int) -> list[dict[str, object]]:
    """Decoded-JSON-like entries: dicts holding lists, so the collector tracks both."""
    return [
        {"Service": {"ID": f"svc-{i}", "Tags": [f"model=m{i}"]}, "Checks": [{"Status": "passing"}]}
        for i in range(n)
    ]


def full_collection_cpu_s() -> float:
    started = time.process_time()
    gc.collect()
    return time.process_time() - started


def test_a_full_collection_after_a_pass_walks_only_what_came_since() -> None:
    readings = held_readings(100_000)  # 400,000 tracked (a dict of strings alone is not)
    heap = HeldHeap(enabled=True)
    try:
        before_cpu, before_walked = full_collection_cpu_s(), len(gc.get_objects())
        heap.after_pass(full=True)
        after_cpu, after_walked = full_collection_cpu_s(), len(gc.get_objects())
    finally:
        heap.release()
    assert gc.get_freeze_count() == 0
    assert before_walked >= 400_000
    assert after_walked < 10_000, after_walked
    # Wide margin: the walk went from 400,000 objects to a few thousand.
    assert after_cpu < before_cpu / 5, (before_cpu, after_cpu)
    assert len(readings) == 100_000


def test_a_garbage_cycle_frozen_by_a_pass_is_collected_at_the_next_full_pass() -> None:
    class Node:
        other: object = None

    heap = HeldHeap(enabled=True)
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        heap.after_pass(full=False)
        del a, b
        gc.collect()
        assert gone() is not None, "frozen: a collection between passes does not walk it"
        heap.after_pass(full=True)
        assert gone() is None, "the full pass unfreezes and collects"
        assert heap.last_collected >= 2
    finally:
        heap.release()


def test_a_replaced_reading_is_freed_though_frozen() -> None:
    """Frozen is not kept: a reading the next one replaces goes by reference counting."""

    class Reading(dict[str, object]):
        pass

    heap = HeldHeap(enabled=True)
    try:
        reading = Reading(entries=held_readings(10))
        gone = weakref.ref(reading)
        heap.after_pass(full=False)
        reading = Reading(entries=held_readings(10))
        assert gone() is None
    finally:
        heap.release()


def test_a_watcher_embedded_in_another_program_leaves_its_heap_alone() -> None:
    frozen = gc.get_freeze_count()
    heap = HeldHeap(enabled=False)
    heap.after_pass(full=True)
    heap.after_pass(full=False)
    assert gc.get_freeze_count() == frozen
