"""The node's weights cache: its bound, and what eviction may never take."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nomad_driver.fetch import cache
from nomad_driver.fetch.errors import NoSpace

MIB = 1024 * 1024


def put(root: Path, model: str, size: int, age_s: float) -> Path:
    path = root / model / f"{model}.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * size)
    cache.mark_complete(root, model, f"https://example/{model}.gguf", path.name, size, None)
    then = time.time() - age_s
    os.utime(root / model / cache.COMPLETE, (then, then))
    return path


@pytest.fixture
def engine_on(tmp_path):
    """A running process whose command line names a model file, as a running engine's does."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(path: Path) -> None:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(path)]))

    yield start
    for p in procs:
        p.kill()
        p.wait()


def usage(root: Path) -> int:
    return sum(e.size for e in cache.entries(root))


def test_eviction_keeps_the_cache_under_its_bound_least_recently_used_first(tmp_path):
    put(tmp_path, "oldest", 4 * MIB, age_s=3 * 3600)
    put(tmp_path, "older", 4 * MIB, age_s=2 * 3600)
    put(tmp_path, "old", 4 * MIB, age_s=1 * 3600)
    evicted = cache.make_room(tmp_path, "new", 6 * MIB, 14 * MIB)
    assert evicted == ["oldest", "older"]
    assert usage(tmp_path) + 6 * MIB <= 14 * MIB
    assert (tmp_path / "old" / "old.gguf").exists()


def test_eviction_never_removes_weights_in_use(tmp_path, engine_on):
    served = put(tmp_path, "served", 4 * MIB, age_s=3 * 3600)
    engine_on(served)
    put(tmp_path, "just-fetched", 4 * MIB, age_s=5)  # its engine has not started yet
    put(tmp_path, "idle", 4 * MIB, age_s=3600)
    with pytest.raises(NoSpace) as refused:
        cache.make_room(tmp_path, "new", 8 * MIB, 12 * MIB)
    assert "every other model there is in use" in refused.value.line()
    assert (tmp_path / "served" / "served.gguf").exists()
    assert (tmp_path / "just-fetched" / "just-fetched.gguf").exists()
    # Nothing was evicted for a download that could not fit anyway.
    assert (tmp_path / "idle" / "idle.gguf").exists()
    assert cache.make_room(tmp_path, "new", 4 * MIB, 13 * MIB) == ["idle"]


def test_a_model_being_fetched_is_in_use(tmp_path):
    put(tmp_path, "downloading", 4 * MIB, age_s=3600)
    with cache.locked(tmp_path, "downloading"), pytest.raises(NoSpace):
        cache.make_room(tmp_path, "new", 4 * MIB, 6 * MIB)
    assert cache.make_room(tmp_path, "new", 4 * MIB, 6 * MIB) == ["downloading"]
