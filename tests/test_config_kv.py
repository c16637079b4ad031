"""Definitions in Consul KV, one key per model (nomad_driver/config_kv.py, config_store.py):
what `llmgw apply` writes, how every reader reads it, the upgrade from the single key, and an
apply that stops half way."""

from __future__ import annotations

import asyncio
import time

import pytest

from nomad_driver.cli.apply import ApplyConflict, store_definitions
from nomad_driver.cli.plan import stored_definitions
from nomad_driver.config_kv import (
    APPLIED_KEY,
    CONFIG_PREFIX,
    LEGACY_MODELS_KEY,
    MODEL_KEY_PREFIX,
    PROFILES_KEY,
    StoredDefinitions,
    config_entries,
    definition_keys,
    model_key,
    parse_applied,
)
from nomad_driver.config_store import StoreConflict, store_keys
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.watcher.views import Definitions
from nomad_driver.watcher.watch import kv_fetch
from router.config import ConsulSettings
from router.discovery import Discovery

PROFILES = """profiles:
  gpu:
    engine: llama.cpp
    engine_version: b6500
    gpus: 1
    gpu_memory_mib: 24000
"""


def models_text(n: int, *, replicas_max: int = 2, start: int = 0) -> str:
    body = "".join(
        f"  m{i}:\n    source: file:///models/m{i}.gguf\n    profile: gpu\n"
        f"    replicas: {{min: 0, max: {replicas_max}}}\n"
        for i in range(start, start + n)
    )
    return PROFILES + "models:\n" + body


async def read_all(consul: Consul) -> dict[str, KVEntry]:
    _, entries = await consul.kv_get(CONFIG_PREFIX, recurse=True)
    return config_entries(entries)


async def test_apply_writes_one_key_per_model_the_profiles_and_the_commit(consul_url: str) -> None:
    consul = Consul(consul_url)
    try:
        assert await store_definitions(consul, models_text(3))
        kv = await read_all(consul)
        assert set(kv) == {APPLIED_KEY, PROFILES_KEY, *(model_key(f"m{i}") for i in range(3))}
        applied = parse_applied(kv[APPLIED_KEY].value)
        assert (applied.generation, applied.models, applied.pending) == (1, 3, None)

        # A change to one model rewrites that key and the commit, nothing else.
        before = {k: e.modify_index for k, e in kv.items()}
        changed = models_text(3).replace("m1.gguf", "m1-v2.gguf")
        assert await store_definitions(consul, changed)
        kv = await read_all(consul)
        moved = {k for k, e in kv.items() if e.modify_index != before[k]}
        assert moved == {model_key("m1"), APPLIED_KEY}
        assert parse_applied(kv[APPLIED_KEY].value).generation == 2

        # The same definitions again (a comment changes no key) write nothing.
        assert not await store_definitions(consul, changed + "# a comment\n")
        # A model left out of the file loses its key.
        assert await store_definitions(consul, models_text(2))
        assert model_key("m2") not in await read_all(consul)
    finally:
        await consul.close()


async def test_ten_thousand_models_apply_without_413_and_read_back_whole(consul_url: str) -> None:
    """The single key stopped at 512 KiB (`kv_max_value_size`): about 2,000 models of this size."""
    text = models_text(10_000)
    assert len(text.encode()) > 512 * 1024  # what the single key refused with 413
    consul = Consul(consul_url)
    try:
        started = time.monotonic()
        keys = definition_keys(text)  # the file validated whole, then split
        split = time.monotonic()
        written = await store_keys(consul, keys)
        stored_at = time.monotonic()
        kv = await read_all(consul)
        stored = StoredDefinitions()
        stored.read(kv)
        print(
            f"10,000 models: validated and split in {split - started:.2f} s, stored in "
            f"{stored_at - split:.2f} s ({written.transactions} transactions), read back and "
            f"parsed in {time.monotonic() - stored_at:.2f} s"
        )
        assert len(stored.models) == 10_000 and not stored.problems
        assert parse_applied(kv[APPLIED_KEY].value).models == 10_000
        # A change of one model among them is claim + one transaction.
        result = await store_keys(consul, definition_keys(text.replace("m77.gguf", "m77-b.gguf")))
        assert (result.written, result.transactions) == (1, 2)
    finally:
        await consul.close()


async def test_apply_moves_the_single_key_over_and_readers_follow(consul_url: str) -> None:
    consul = Consul(consul_url)
    try:
        old = models_text(2)
        await consul.kv_put(LEGACY_MODELS_KEY, old)
        reader = StoredDefinitions()
        reader.read(await read_all(consul))
        assert (reader.layout, sorted(reader.models)) == ("legacy key", ["m0", "m1"])

        assert await store_definitions(consul, old)
        kv = await read_all(consul)
        assert LEGACY_MODELS_KEY not in kv  # deleted in the committing transaction
        assert sorted(k for k in kv if k.startswith(MODEL_KEY_PREFIX)) == [model_key("m0"), model_key("m1")]
        assert reader.read(kv) is False  # the same models: nothing changed for its users
        assert reader.layout == "model keys"

        # A single key written again (Terraform owns it) wins while it exists.
        await consul.kv_put(LEGACY_MODELS_KEY, models_text(1, start=5))
        reader.read(await read_all(consul))
        assert (reader.layout, sorted(reader.models)) == ("legacy key", ["m5"])
    finally:
        await consul.close()


async def test_a_bad_model_key_is_named_and_harms_only_its_model(consul_url: str) -> None:
    consul = Consul(consul_url)
    try:
        await store_definitions(consul, models_text(3))
        watcher, plan_reader = Definitions(), StoredDefinitions()
        watcher.load(await read_all(consul))
        good_m1 = watcher.models["m1"]

        await consul.kv_put(model_key("m1"), '{"source": "file:///x.gguf", "profile": "gpu9"}')
        await consul.kv_put(model_key("m3"), "source: [not, a, string]\nprofile: gpu\n")
        kv = await read_all(consul)
        watcher.load(kv)
        plan_reader.read(kv)
        for reader in (watcher, plan_reader):
            assert any(p.startswith(f"{model_key('m1')}: ") and "gpu9" in p for p in reader.problems)
            assert any(p.startswith(f"{model_key('m3')}: ") for p in reader.problems)
            assert "m0" in reader.models and "m2" in reader.models and "m3" not in reader.models
        # The watcher held m1, so it keeps m1's last good definition; a reader that never saw
        # it good does not invent one.
        assert watcher.models["m1"] == good_m1
        assert "m1" not in plan_reader.models

        # Fixed, it is read again, and only it.
        await consul.kv_put(model_key("m1"), '{"source": "file:///models/m1-v3.gguf", "profile": "gpu"}')
        watcher.load(await read_all(consul))
        assert watcher.models["m1"].source == "file:///models/m1-v3.gguf"
        assert all(not p.startswith(model_key("m1")) for p in watcher.problems)

        # `llmgw plan` compares the good ones and says which key it could not read.
        models, note = await asyncio.to_thread(stored_definitions, Consul(consul_url))
        assert models is not None and "m0" in models and "m3" not in models
        assert note.startswith(model_key("m3"))
    finally:
        await consul.close()


async def test_readers_hold_their_set_while_an_apply_is_pending_and_the_next_apply_finishes_it(
    consul_url: str,
) -> None:
    consul = Consul(consul_url)
    try:
        await store_definitions(consul, models_text(3))
        reader = StoredDefinitions()
        reader.read(await read_all(consul))
        held = dict(reader.models)

        # An apply that claimed, wrote one changed key and died before its commit.
        applied = parse_applied((await read_all(consul))[APPLIED_KEY].value)
        interrupted = type(applied)(applied.generation, applied.models, {"generation": 2, "by": "gone"})
        await consul.kv_put(APPLIED_KEY, interrupted.to_bytes())
        await consul.kv_put(model_key("m0"), '{"source": "file:///half.gguf", "profile": "gpu"}')
        await consul.kv_delete(model_key("m2"))
        assert reader.read(await read_all(consul)) is False
        assert reader.models == held and reader.pending

        # A reader started meanwhile has nothing to hold: it reads the keys as they are.
        fresh = StoredDefinitions()
        fresh.read(await read_all(consul))
        assert sorted(fresh.models) == ["m0", "m1"] and fresh.pending

        # The next apply takes the claim over and commits a whole set.
        assert await store_definitions(consul, models_text(4, replicas_max=3))
        kv = await read_all(consul)
        assert parse_applied(kv[APPLIED_KEY].value).generation == 3
        assert reader.read(kv) is True
        assert not reader.pending
        assert sorted(reader.models) == ["m0", "m1", "m2", "m3"]
        assert {m.replicas_max for m in reader.models.values()} == {3}
    finally:
        await consul.close()


async def test_an_apply_that_lost_its_claim_stops_and_says_so(consul_url: str) -> None:
    consul = Consul(consul_url)
    try:
        await store_definitions(consul, models_text(2))
        wanted = definition_keys(models_text(200, replicas_max=3))
        real_txn = consul.txn
        calls = 0

        async def txn_with_a_rival(ops: list[dict[str, object]]) -> object:
            nonlocal calls
            calls += 1
            if calls == 2:  # after our claim, another apply claims over it
                rival = parse_applied((await read_all(consul))[APPLIED_KEY].value)
                await consul.kv_put(
                    APPLIED_KEY, type(rival)(rival.generation, 2, {"generation": 9}).to_bytes()
                )
            return await real_txn(ops)

        consul.txn = txn_with_a_rival  # type: ignore[method-assign]
        with pytest.raises(StoreConflict, match="taken over by another apply"):
            await store_keys(consul, wanted)
        consul.txn = real_txn  # type: ignore[method-assign]
        # It wrote nothing after it lost the claim (its first chunk was refused whole).
        kv = await read_all(consul)
        assert sum(1 for k in kv if k.startswith(MODEL_KEY_PREFIX)) == 2

        # A claim that moved between the read and the claim itself is the old "run it again".
        stale = await read_all(consul)
        await consul.kv_put(APPLIED_KEY, stale[APPLIED_KEY].value + b" ")

        async def read_stale(*args: object, **kwargs: object) -> tuple[int, list[KVEntry]]:
            return 0, list(stale.values())

        consul.kv_get = read_stale  # type: ignore[method-assign,assignment]
        with pytest.raises(ApplyConflict, match="changed by someone else"):
            await store_definitions(consul, models_text(1))
    finally:
        await consul.close()


async def test_the_router_and_the_watcher_read_the_same_set(consul_url: str) -> None:
    consul = Consul(consul_url)
    discovery = Discovery(ConsulSettings(addr=consul_url, wait_s=1))
    try:
        await store_definitions(consul, models_text(50))
        await consul.kv_put(model_key("m7"), "not: [a, model")
        _, everything = await kv_fetch(consul, CONFIG_PREFIX, 1)(0)  # the watcher's read of llmgw/config/
        watcher = Definitions()
        watcher.load(everything, 1)
        _, router_read = await discovery._fetch_models(0)  # the router's: llmgw/config/ only
        discovery.models_watch.snapshot = _reading(router_read)
        discovery._apply_models()
        routed = discovery.snapshot
        assert dict(routed.models) == watcher.models
        assert len(watcher.models) == 49
        assert model_key("m7") in routed.models_error and routed.models_error == watcher.problem
    finally:
        await discovery.consul.close()
        await consul.close()


def _reading(data: dict[str, KVEntry]) -> object:
    from nomad_driver.blocking import Reading

    return Reading(1, data, time.monotonic())
