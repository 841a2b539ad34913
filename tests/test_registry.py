"""The registry service through its API: a real nats-server, a real registry process."""
from __future__ import annotations

import asyncio
import signal

import msgspec
import pytest

from shared.bus import Bus, BusSettings
from shared.events.common import LayerRange
from shared.events.registry import (
    AdapterRecord, Bucket, CatalogChanged, CatalogEntry, InstanceRecord, ModelRecord, PutReply, RegistryConflict, RegistryGet,
    RegistryNotFound, RegistryPut, RegistryWritten,
)
from shared.nats_server import NatsServer
from shared.registry_client import RegistryClient
from shared.subjects import kv_bucket, registry_changed, registry_op
from shared.wire import BAD_REQUEST, UNKNOWN_MESSAGE, RemoteError, RevisionConflict
from service_procs import ServiceProcess, wait_ready, write_config

pytestmark = pytest.mark.timeout(120)


def model(name: str, layers: int = 4, path: str = "/models/x") -> ModelRecord:
    return ModelRecord(name=name, path=path, num_layers=layers, max_context=2048)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One nats-server and one registry process for the module's API tests."""
    root = tmp_path_factory.mktemp("registry")
    server = NatsServer(store_dir=root / "nats").start()
    registry = ServiceProcess("registry", server.url, write_config(root), "registry-t1").start()
    try:
        yield server, registry
    finally:
        registry.stop()
        server.stop()


@pytest.fixture
async def client(cluster):
    server, registry = cluster
    bus = await Bus.connect(BusSettings(url=server.url), service="dispatcher")
    await wait_ready(bus, registry)
    try:
        yield RegistryClient(bus, timeout=5.0)
    finally:
        await bus.close()


async def test_two_writers_same_base_revision_one_wins_one_gets_conflict(client):
    base = await client.create(model("cas-a"))
    bus = client.bus
    puts = [
        RegistryPut(idempotency_key=f"writer-{i}", record=model("cas-a", layers=8 + i), expected_revision=base)
        for i in range(2)
    ]
    replies = await asyncio.gather(*(bus.request(registry_op("put"), p, PutReply, timeout=5) for p in puts))
    written = [r for r in replies if isinstance(r, RegistryWritten)]
    conflicts = [r for r in replies if isinstance(r, RegistryConflict)]
    assert len(written) == 1 and len(conflicts) == 1, replies
    conflict = conflicts[0]
    assert (conflict.bucket, conflict.key, conflict.expected_revision) == (Bucket.MODELS, "cas-a", base)
    assert conflict.actual_revision == written[0].revision > base
    stored = await client.get(Bucket.MODELS, "cas-a")
    winner = replies.index(written[0])
    assert stored.revision == written[0].revision and stored.record.num_layers == 8 + winner  # nothing overwritten


async def test_client_raises_typed_conflict_and_create_refuses_existing(client):
    rev = await client.create(model("cas-b"))
    rev2 = await client.put(model("cas-b", layers=5), rev)
    with pytest.raises(RevisionConflict) as stale:
        await client.put(model("cas-b", layers=6), rev)  # a writer still holding the old revision
    assert stale.value.code == "conflict" and stale.value.key == "cas-b"
    assert (stale.value.expected, stale.value.actual) == (rev, rev2)
    with pytest.raises(RevisionConflict) as exists:
        await client.create(model("cas-b"))
    assert exists.value.expected == 0 and exists.value.actual is not None
    assert (await client.get(Bucket.MODELS, "cas-b")).record.num_layers == 5


async def test_retried_write_with_same_idempotency_key_is_replayed_not_conflicted(client):
    rev = await client.create(model("idem"))
    put = RegistryPut(idempotency_key="retry-1", record=model("idem", layers=9), expected_revision=rev)
    first = await client.bus.request(registry_op("put"), put, PutReply)
    again = await client.bus.request(registry_op("put"), put, PutReply)
    assert isinstance(first, RegistryWritten) and not first.replayed
    assert isinstance(again, RegistryWritten) and again.replayed and again.revision == first.revision
    reused = RegistryPut(idempotency_key="retry-1", record=model("idem", layers=10), expected_revision=first.revision)
    with pytest.raises(RemoteError) as err:
        await client.bus.request(registry_op("put"), reused, PutReply)
    assert err.value.code == BAD_REQUEST and err.value.field == "idempotency_key"


async def test_get_list_delete_with_compare_and_set(client):
    assert await client.get(Bucket.MODELS, "absent") is None
    revs = {name: await client.create(model(name)) for name in ("lst-1", "lst-2", "lst-3")}
    listed = await client.list(Bucket.MODELS, prefix="lst-", page=2)  # two pages
    assert [e.key for e in listed] == ["lst-1", "lst-2", "lst-3"]
    assert [e.revision for e in listed] == [revs["lst-1"], revs["lst-2"], revs["lst-3"]]
    with pytest.raises(RevisionConflict):
        await client.delete(Bucket.MODELS, "lst-2", revs["lst-2"] + 1000)
    assert await client.delete(Bucket.MODELS, "lst-2", revs["lst-2"]) is True
    assert await client.get(Bucket.MODELS, "lst-2") is None
    assert await client.delete(Bucket.MODELS, "lst-2", revs["lst-2"]) is False  # already gone
    assert [e.key for e in await client.list(Bucket.MODELS, prefix="lst-")] == ["lst-1", "lst-3"]


async def test_watch_delivers_current_records_then_changes(client):
    rec = InstanceRecord(instance_id="inst-1", model="m", worker_id="w0", layers=LayerRange(start=0, end=4))
    rev = await client.create(rec)
    async with client.watch(Bucket.INSTANCES) as changes:
        first = await asyncio.wait_for(anext(changes), 5)
        assert (first.op, first.key, first.revision) == ("put", "inst-1", rev)
        rev2 = await client.put(msgspec.structs.replace(rec, state="ready"), rev)
        second = await asyncio.wait_for(anext(changes), 5)
        assert (second.op, second.revision, second.record.state) == ("put", rev2, "ready")
        await client.delete(Bucket.INSTANCES, "inst-1", rev2)
        third = await asyncio.wait_for(anext(changes), 5)
        assert third.op == "delete" and third.record is None and third.revision > rev2


async def test_malformed_and_unknown_requests_get_typed_errors_and_registry_keeps_serving(client):
    nc = client.bus.nc
    for payload, code in ((b"\xc1garbage", BAD_REQUEST), (msgspec.msgpack.encode({"type": "no_such"}), UNKNOWN_MESSAGE)):
        reply = await nc.request(registry_op("get"), payload, timeout=5)
        assert reply.headers and reply.headers.get("tidal-error") == code
    bad_key = msgspec.msgpack.encode({"type": "registry_get", "bucket": "models", "key": "bad key!"})
    reply = await nc.request(registry_op("get"), bad_key, timeout=5)
    assert reply.headers.get("tidal-error") == BAD_REQUEST
    found = await client.bus.request(registry_op("get"), RegistryGet(bucket=Bucket.MODELS, key="nope"),
                                     CatalogEntry | RegistryNotFound)
    assert isinstance(found, RegistryNotFound)


async def test_every_applied_write_publishes_a_change_event(client):
    seen: list[CatalogChanged] = []
    arrived = asyncio.Event()

    async def on_change(event: CatalogChanged, _ctx) -> None:
        seen.append(event)
        arrived.set()

    sub = await client.bus.subscribe(registry_changed("adapters"), CatalogChanged, on_change)
    rev = await client.create(AdapterRecord(name="ad-1", base="m", path="/a", rank=8, targets=["q_proj"]))
    await asyncio.wait_for(arrived.wait(), 5)
    assert (seen[0].bucket, seen[0].key, seen[0].revision, seen[0].op) == (Bucket.ADAPTERS, "ad-1", rev, "put")
    assert seen[0].record.rank == 8
    await sub.unsubscribe()


async def test_registry_restart_and_nats_restart_keep_acknowledged_records(tmp_path):
    """Register, kill the registry (SIGKILL) and restart nats-server on the same store: still there."""
    server = NatsServer(store_dir=tmp_path / "nats").start()
    config = write_config(tmp_path)
    registry = ServiceProcess("registry", server.url, config, "registry-r1").start()
    bus = await Bus.connect(BusSettings(url=server.url), service="dispatcher")
    try:
        await wait_ready(bus, registry)
        client = RegistryClient(bus, timeout=5.0)
        revs = {f"durable-{i}": await client.create(model(f"durable-{i}", layers=i + 1)) for i in range(20)}
        registry.stop(signal.SIGKILL)
        server.restart()  # same port, same JetStream store
        registry = ServiceProcess("registry", server.url, config, "registry-r2").start()
        await wait_ready(bus, registry)  # the bus reconnects by itself
        listed = {e.key: e for e in await client.list(Bucket.MODELS, prefix="durable-")}
        assert {k: e.revision for k, e in listed.items()} == revs
        assert all(listed[f"durable-{i}"].record.num_layers == i + 1 for i in range(20))
        # and compare-and-set continues from the stored revisions
        with pytest.raises(RevisionConflict):
            await client.put(model("durable-0", layers=99), revs["durable-0"] + 1000)
        assert await client.put(model("durable-0", layers=99), revs["durable-0"]) > revs["durable-0"]
        js_info = await bus.js.stream_info(f"KV_{kv_bucket('models')}")
        storage = js_info.config.storage
        assert getattr(storage, "value", storage) == "file"  # on disk, not in memory
    finally:
        await bus.close()
        registry.stop()
        server.stop()


async def test_a_listing_names_each_key_once_while_records_change(client):
    """Workers' heartbeats rewrite their records all the time: a listing taken meanwhile must still name
    every key exactly once, in order (a watch-based listing saw a rewritten key twice, or missed it)."""
    revs = {f"churn-{i:03d}": await client.create(model(f"churn-{i:03d}")) for i in range(60)}
    stop = asyncio.Event()

    async def churn() -> None:
        i = 0
        while not stop.is_set():
            key = f"churn-{i % 60:03d}"
            revs[key] = await client.put(model(key, layers=4 + i % 3), revs[key])
            i += 1

    writers = [asyncio.create_task(churn())]
    try:
        for _ in range(30):
            keys = [e.key for e in await client.list(Bucket.MODELS, prefix="churn-")]
            assert keys == sorted(set(keys)), [k for k in keys if keys.count(k) > 1]
            assert len(keys) == 60, sorted(set(revs) - set(keys))  # none missed either, though each is rewritten
    finally:
        stop.set()
        await asyncio.gather(*writers)
