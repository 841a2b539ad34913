"""The typed event catalog: tags, round trips, bounds, invariants (pure; no I/O)."""
from __future__ import annotations

import typing

import msgspec
import pytest

from shared import events as ev
from shared import subjects
from shared.events.base import Message

ALL = ev.all_messages()


def _sample(cls: type) -> Message:
    """A minimal valid instance of each message type (exercises every family)."""
    layers = ev.LayerRange(start=0, end=2)
    member = ev.GroupMember(worker_id="cpu-0", instance_id="i0", layers=layers)
    pool = ev.PoolBreakdown(capacity_bytes=1 << 30, kv_bytes=1 << 20, free_bytes=(1 << 30) - (1 << 20))
    model = ev.ModelRecord(name="qwen2.5-0.5b", path="/m", num_layers=24, max_context=4096)
    common = dict(idempotency_key="k1")
    samples: dict[type, Message] = {
        ev.SubmitRequest: ev.SubmitRequest(request_id="r1", model="m", prompt_token_ids=[1, 2], arrival_ts=1.0),
        ev.SubmitAccepted: ev.SubmitAccepted(request_id="r1", worker_id="cpu-0", instance_id="i0"),
        ev.SubmitRejected: ev.SubmitRejected(request_id="r1", reason="queue_full", message="full"),
        ev.DispatchStats: ev.DispatchStats(dispatcher_id="d1", ts=1.0, interval_s=1.0,
                                           models=[ev.ModelLoad(model="m", arrivals=3)]),
        ev.Assignment: ev.Assignment(request_id="r1", instance_id="i0", model="m", prompt_token_ids=[1],
                                     arrival_ts=1.0, attempt=1, resume_token_ids=[5], next_seq=1, **common),
        ev.AssignAccepted: ev.AssignAccepted(request_id="r1", worker_id="cpu-0", instance_id="i0"),
        ev.AssignRejected: ev.AssignRejected(request_id="r1", worker_id="cpu-0", reason="draining", message="x"),
        ev.WorkerStats: ev.WorkerStats(worker_id="cpu-0", seq=0, ts=1.0, device="cpu", state=ev.WorkerState.READY,
                                       pool=pool, instances=[ev.InstanceStats(instance_id="i0", model="m",
                                                                              layers=layers)]),
        ev.WorkerHeartbeat: ev.WorkerHeartbeat(worker_id="cpu-0", incarnation="a", seq=0, ts=1.0,
                                               state=ev.WorkerState.READY),
        ev.PrefixSummary: ev.PrefixSummary(worker_id="cpu-0", instance_id="i0", model="m", seq=3, ts=1.0,
                                           block_size=16, hashes=[2**64 - 1, 0, 12345], held_blocks=3,
                                           cached_free_blocks=1, queried_blocks=10, hit_blocks=4),
        ev.LoadModel: ev.LoadModel(model="m", instance_id="i0", **common),
        ev.EvictModel: ev.EvictModel(model="m", **common),
        ev.LoadAdapter: ev.LoadAdapter(adapter="a", base="m", **common),
        ev.EvictAdapter: ev.EvictAdapter(adapter="a", **common),
        ev.OffloadAdapter: ev.OffloadAdapter(adapter="a", **common),
        ev.EvictPrefixBlocks: ev.EvictPrefixBlocks(instance_id="i1", blocks=12, **common),
        ev.DropLayers: ev.DropLayers(instance_id="i0", group_id="g", layers=layers, **common),
        ev.RestoreLayers: ev.RestoreLayers(instance_id="i0", layers=layers, **common),
        ev.Prewarm: ev.Prewarm(model="m", layers=layers, **common),
        ev.JoinGroup: ev.JoinGroup(group_id="g", instance_id="i0", members=[member, member], **common),
        ev.LeaveGroup: ev.LeaveGroup(group_id="g", instance_id="i0", **common),
        ev.MigrateOut: ev.MigrateOut(request_id="r1", destination="cpu-1", destination_instance="i1", **common),
        ev.MigrateIn: ev.MigrateIn(request_id="r1", source="cpu-0", instance_id="i1", mode="tokens", **common),
        ev.MigrateKvStage: ev.MigrateKvStage(request_id="r1", source="cpu-0", stage=0, key="kv:r1:0", first_block=0,
                                             last_block=4, reserve_tokens=64, **common),
        ev.MigrateKvCancel: ev.MigrateKvCancel(request_id="r1", source="cpu-0", reason="corrupt", **common),
        ev.CtlDone: ev.CtlDone(command="load_model", worker_id="cpu-0", pool=pool, **common),
        ev.CtlRefused: ev.CtlRefused(command="prewarm", worker_id="cpu-0", code="unsupported", message="x", **common),
        ev.TokenChunk: ev.TokenChunk(request_id="r1", seq=3, token_ids=[7], text="é", finish_reason="stop",
                                     usage=ev.Usage(prompt_tokens=2, completion_tokens=4)),
        ev.StreamError: ev.StreamError(request_id="r1", seq=4, code="redispatch_limit", message="x"),
        ev.StreamReassigned: ev.StreamReassigned(request_id="r1", attempt=1, from_seq=4, worker_id="w0"),
        ev.AbortRequest: ev.AbortRequest(request_id="r1", reason="client_disconnected", ts=1.0),
        ev.ModelRecord: model,
        ev.AdapterRecord: ev.AdapterRecord(name="a", base="m", path="/a", rank=8, targets=["q_proj"]),
        ev.WorkerRecord: ev.WorkerRecord(worker_id="cpu-0", device="cpu", memory_capacity_bytes=1 << 30),
        ev.InstanceRecord: ev.InstanceRecord(instance_id="i0", model="m", worker_id="cpu-0", layers=layers),
        ev.GroupRecord: ev.GroupRecord(group_id="g", model="m", members=[member, member]),
        ev.ServiceRecord: ev.ServiceRecord(service_id="gateway-1", service="gateway"),
        ev.LeaseRecord: ev.LeaseRecord(name="planner", holder="planner-1", term=2, ttl_s=3.0),
        ev.RegistryGet: ev.RegistryGet(bucket=ev.Bucket.MODELS, key="m"),
        ev.RegistryList: ev.RegistryList(bucket=ev.Bucket.WORKERS),
        ev.RegistryPut: ev.RegistryPut(record=model, expected_revision=0, **common),
        ev.RegistryDelete: ev.RegistryDelete(bucket=ev.Bucket.MODELS, key="m", expected_revision=3, **common),
        ev.CatalogEntry: ev.CatalogEntry(bucket=ev.Bucket.MODELS, key="m", revision=1, record=model),
        ev.RegistryNotFound: ev.RegistryNotFound(bucket=ev.Bucket.MODELS, key="m"),
        ev.RegistryListing: ev.RegistryListing(bucket=ev.Bucket.MODELS, entries=[
            ev.CatalogEntry(bucket=ev.Bucket.MODELS, key="m", revision=1, record=model)]),
        ev.RegistryWritten: ev.RegistryWritten(bucket=ev.Bucket.MODELS, key="m", revision=2),
        ev.RegistryConflict: ev.RegistryConflict(bucket=ev.Bucket.MODELS, key="m", expected_revision=1,
                                                 actual_revision=2),
        ev.RegistryDeleted: ev.RegistryDeleted(bucket=ev.Bucket.MODELS, key="m", revision=3),
        ev.CatalogChanged: ev.CatalogChanged(bucket=ev.Bucket.MODELS, key="m", revision=1, op="put",
                                             record=model, ts=1.0),
        ev.ServiceHeartbeat: ev.ServiceHeartbeat(service_id="gateway-1", service="gateway", seq=0, ts=1.0),
        ev.FormGroup: ev.FormGroup(group_id="g", model="m", members=[member, member]),
        ev.DissolveGroup: ev.DissolveGroup(group_id="g"),
        ev.Migrate: ev.Migrate(request_id="r1", source="cpu-0", destination="cpu-1", destination_instance="i1"),
        ev.DropInstanceLayers: ev.DropInstanceLayers(worker_id="cpu-0", instance_id="i1", group_id="g", layers=layers),
        ev.RestoreInstanceLayers: ev.RestoreInstanceLayers(worker_id="cpu-0", instance_id="i1", layers=layers),
        ev.ReportIdle: ev.ReportIdle(worker_id="cpu-1", since_ts=3.0),
        ev.PlacePrewarm: ev.PlacePrewarm(worker_id="cpu-0", model="m", layers=layers),
        ev.ReleasePrewarm: ev.ReleasePrewarm(worker_id="cpu-0", model="m"),
        ev.ReleaseAdapter: ev.ReleaseAdapter(worker_id="cpu-0", adapter="a"),
        ev.ReleasePrefixBlocks: ev.ReleasePrefixBlocks(worker_id="cpu-0", instance_id="i1", blocks=12),
        ev.ScaleUp: ev.ScaleUp(model="m", worker_id="cpu-1", instance_id="i2"),
        ev.ScaleDown: ev.ScaleDown(instance_id="i2", worker_id="cpu-1"),
        ev.PlanDecided: ev.PlanDecided(plan=ev.Plan(plan_id="p1", ts=1.0, trigger="kv_pressure",
                                                    actions=[ev.DissolveGroup(group_id="g")])),
        ev.PlanApplied: ev.PlanApplied(plan_id="p1", ts=2.0, duration_s=1.0),
        ev.PlanFailed: ev.PlanFailed(plan_id="p1", ts=2.0, action_index=0, message="x"),
        ev.PlanCancelled: ev.PlanCancelled(plan_id="p1", ts=2.0, message="stale: worker w1 is dead"),
        ev.PlanPurchased: ev.PlanPurchased(
            purchase_id="p1-buy-1", ts=2.0, scope="worker:w1", need_bytes=1 << 30, horizon_s=10.0, waiting=3,
            reserve_request_s_per_byte=1e-8,
            prices=[ev.SourcePrice(source="adapter", target="w1/a3", bytes=1 << 26, price_request_s=0.01,
                                   bought=True, plan_ids=["p1-7"]),
                    ev.SourcePrice(source="layers", target="w1+w2", bytes=1 << 31, price_request_s=40.0)],
            bought_bytes=1 << 26, price_request_s=9.5, reason="kv pressure"),
        ev.PurchaseLogRequest: ev.PurchaseLogRequest(limit=5),
        ev.PurchaseLogReply: ev.PurchaseLogReply(planner_id="planner-1", economy="arbiter", purchases=[]),
        ev.CapacityRequest: ev.CapacityRequest(dispatcher_id="d1", model="m", queued_requests=4, ts=1.0),
        ev.CapacityReply: ev.CapacityReply(model="m", outcome="none"),
        ev.PlacementHints: ev.PlacementHints(model="m", ts=1.0, capacity_bytes=800, valid_until=4.0, entries=[
            ev.PlacementEntry(request_class="tiny", lower_bytes=0, upper_bytes=100, worker_id="cpu-0", room_bytes=500),
            ev.PlacementEntry(request_class="L", lower_bytes=400, upper_bytes=800)]),
        ev.Forecast: ev.Forecast(model="m", predictor_id="p", issued_ts=1.0, window_start_ts=60.0, window_s=60.0,
                                 avg_rps=2.0, peak_rps=5.0),
    }
    return samples[cls]


def test_every_message_has_a_unique_snake_case_tag_in_field_type():
    tags = [ev.message_tag(cls) for cls in ALL]
    assert len(set(tags)) == len(tags)
    assert len({cls.__name__ for cls in ALL}) == len(ALL)
    assert ev.message_tag(ev.SubmitRequest) == "submit_request"
    assert all(cls.__struct_config__.tag_field == "type" for cls in ALL)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_round_trip_msgpack_and_json(cls):
    msg = _sample(cls)
    wire = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(wire, type=cls) == msg
    assert msgspec.json.decode(msgspec.json.encode(msg), type=cls) == msg
    assert msgspec.json.decode(msgspec.json.encode(msg))["type"] == ev.message_tag(cls)


def test_subject_union_dispatches_on_the_tag():
    spec = subjects.CATALOG["worker.ctl"]
    data = msgspec.msgpack.encode(_sample(ev.DropLayers))
    decoded = msgspec.msgpack.decode(data, type=spec.payload_type)
    assert isinstance(decoded, ev.DropLayers) and decoded.layers == ev.LayerRange(start=0, end=2)
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'drop_everything'"):
        msgspec.json.decode(b'{"type": "drop_everything", "idempotency_key": "k"}', type=spec.payload_type)


def test_every_ctl_command_carries_an_idempotency_key():
    for cls in ev.CTL_COMMANDS:
        assert "idempotency_key" in cls.__struct_fields__
        with pytest.raises(msgspec.ValidationError, match="idempotency_key"):
            msgspec.json.decode(msgspec.json.encode({"type": ev.message_tag(cls)}), type=cls)


def test_every_message_is_carried_on_a_subject_or_nested_in_one():
    carried = {t for s in subjects.CATALOG.values() for t in s.payload + s.reply}
    nested = set(typing.get_args(ev.Record)) | set(typing.get_args(ev.PlanAction)) | {ev.CatalogEntry}
    orphans = [cls.__name__ for cls in ALL if cls not in carried | nested]
    assert orphans == []


@pytest.mark.parametrize(
    "cls, payload, needle",
    [
        (ev.AbortRequest, {"request_id": "x" * 65, "ts": 1.0}, "length <= 64"),
        (ev.AbortRequest, {"request_id": "a.b", "ts": 1.0}, "regex"),  # '.' would split a subject token
        (ev.TokenChunk, {"request_id": "r", "seq": -1}, ">= 0"),
        (ev.TokenChunk, {"request_id": "r", "seq": 0, "token_ids": [-3]}, ">= 0"),
        (ev.SubmitRequest, {"request_id": "r", "model": "m", "prompt_token_ids": [], "arrival_ts": 1}, "length >= 1"),
        (ev.SubmitRequest, {"request_id": "r", "model": "m", "prompt_token_ids": [1], "arrival_ts": 1,
                            "sampling": {"temperature": 2.5}}, "<= 2"),
        (ev.SubmitRequest, {"request_id": "r", "model": "m", "prompt_token_ids": [1], "arrival_ts": 1,
                            "sampling": {"stop": ["s"] * 17}}, "length <= 16"),
        (ev.WorkerRecord, {"worker_id": "w", "device": "tpu", "memory_capacity_bytes": 1}, "regex"),
        (ev.AdapterRecord, {"name": "a", "base": "m", "path": "/p", "rank": 0, "targets": ["q_proj"]}, ">= 1"),
    ],
)
def test_decoders_reject_out_of_range_values(cls, payload, needle):
    payload = {"type": ev.message_tag(cls), **payload}
    with pytest.raises(msgspec.ValidationError, match=needle):
        msgspec.msgpack.decode(msgspec.msgpack.encode(payload), type=cls)


def test_invariants_checked_on_decode():
    chunk = {"type": "token_chunk", "request_id": "r", "seq": 0, "finish_reason": "stop"}
    with pytest.raises(msgspec.ValidationError, match="both be set"):
        msgspec.json.decode(msgspec.json.encode(chunk), type=ev.TokenChunk)
    with pytest.raises(msgspec.ValidationError, match="end > start"):
        msgspec.json.decode(b'{"start": 4, "end": 4}', type=ev.LayerRange)
    with pytest.raises(ValueError, match="peak_rps"):
        ev.Forecast(model="m", predictor_id="p", issued_ts=0, window_start_ts=0, window_s=1, avg_rps=3, peak_rps=1)
    with pytest.raises(ValueError, match="min_tokens"):
        ev.SamplingParams(max_tokens=2, min_tokens=3)


def test_unknown_fields_are_ignored_so_v1_can_grow():
    data = msgspec.json.encode({"type": "abort_request", "request_id": "r", "ts": 1.0, "added_in_v1_1": [1, 2]})
    assert msgspec.json.decode(data, type=ev.AbortRequest) == ev.AbortRequest(request_id="r", ts=1.0)


def test_every_field_is_on_the_wire_so_readers_need_no_defaults():
    chunk = msgspec.msgpack.decode(msgspec.msgpack.encode(ev.TokenChunk(request_id="r", seq=1, token_ids=[5])))
    assert set(chunk) == {"type", *ev.TokenChunk.__struct_fields__}
    assert chunk["finish_reason"] is None and chunk["text"] == ""


def test_record_helpers():
    model = _sample(ev.ModelRecord)
    assert ev.record_key(model) == "qwen2.5-0.5b"
    assert ev.record_bucket(model) is ev.Bucket.MODELS
    assert set(ev.BUCKET_RECORD) == set(ev.Bucket)
    for record_type in typing.get_args(ev.Record):
        assert ev.RECORD_BUCKET[record_type] in ev.Bucket
