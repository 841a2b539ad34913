"""Typed JetStream KV against a real nats-server: compare-and-set, create, delete, keys, watch."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from shared.bus import Bus, BusSettings
from shared.wire import KeyExists, RevisionConflict


class Model(msgspec.Struct, frozen=True):
    name: str
    layers: int


@pytest.fixture
async def bus(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url), service="kvtest")
    yield bus
    await bus.close()


async def test_compare_and_set_conflict_names_key_and_revisions(bus) -> None:
    models = await bus.kv("models", Model, history=5)
    rev1 = await models.create("llama", Model(name="llama", layers=2))
    entry = await models.get("llama")
    assert entry is not None and entry.value == Model(name="llama", layers=2) and entry.revision == rev1
    rev2 = await models.update("llama", Model(name="llama", layers=4), rev1)  # writer 1 read rev1 and wins
    with pytest.raises(RevisionConflict) as info:  # writer 2 also read rev1: it must not overwrite
        await models.update("llama", Model(name="llama", layers=8), rev1)
    conflict = info.value
    assert (conflict.key, conflict.expected, conflict.actual, conflict.code) == ("llama", rev1, rev2, "conflict")
    assert "llama" in str(conflict) and f"expected revision {rev1}" in str(conflict)
    assert (await models.get("llama")).value.layers == 4  # the loser changed nothing


async def test_create_fails_if_present_and_works_after_delete(bus) -> None:
    models = await bus.kv("models", Model)
    rev = await models.create("qwen", Model(name="qwen", layers=2))
    with pytest.raises(KeyExists) as info:
        await models.create("qwen", Model(name="qwen", layers=3))
    assert info.value.actual == rev
    with pytest.raises(RevisionConflict):
        await models.delete("qwen", revision=rev + 100)  # CAS delete at a stale revision
    await models.delete("qwen", revision=rev)
    assert await models.get("qwen") is None
    assert await models.keys() == []
    await models.create("qwen", Model(name="qwen", layers=5))  # a deleted key can be created again
    assert (await models.get("qwen")).value.layers == 5


async def test_keys_items_and_a_bucket_that_survives_reopening(bus) -> None:
    models = await bus.kv("models", Model)
    for name in ("b", "a", "c"):
        await models.put(name, Model(name=name, layers=1))
    assert await models.keys() == ["a", "b", "c"]
    again = await bus.kv("models", Model, create=False)
    assert [e.key for e in await again.items()] == ["a", "b", "c"]


async def test_watch_yields_typed_changes(bus) -> None:
    models = await bus.kv("models", Model)
    await models.put("old", Model(name="old", layers=1))
    async with models.watch() as changes:
        first = await asyncio.wait_for(changes.__anext__(), 5)
        assert (first.op, first.key, first.value) == ("put", "old", Model(name="old", layers=1))
        rev = await models.put("new", Model(name="new", layers=2))
        await models.delete("old")
        put = await asyncio.wait_for(changes.__anext__(), 5)
        assert (put.op, put.key, put.revision, put.value) == ("put", "new", rev, Model(name="new", layers=2))
        gone = await asyncio.wait_for(changes.__anext__(), 5)
        assert (gone.op, gone.key, gone.value) == ("delete", "old", None)


async def test_watch_without_initial_values_and_undecodable_values_are_skipped(bus) -> None:
    models = await bus.kv("models", Model)
    await models.put("before", Model(name="before", layers=1))
    async with models.watch(include_initial=False) as changes:
        await models.raw.put("garbage", b"\xc1 not a model")  # a bad record must not kill the watcher
        await models.put("after", Model(name="after", layers=3))
        change = await asyncio.wait_for(changes.__anext__(), 5)
        assert (change.key, change.value) == ("after", Model(name="after", layers=3))
