"""Chaos for buddy groups (issue 27 item 7): real worker processes, a real dispatcher and registry on a
real nats-server; requests keep arriving through the dispatcher while groups are formed by the
planner's effects (`services.planner.apply`: FormGroup, DropInstanceLayers, RestoreInstanceLayers,
DissolveGroup) and, in turn, either a member is SIGKILLed and restarted (as `tidal up` does) or the
group is restored and dissolved under load. Liveness is the fast one (`dead_after` 1 s), so the
dispatcher re-dispatches a dead member's requests on the same silence the survivor collapses on.

At the end every stream ended — exactly the tokens of an unsplit run, or a StreamError (a clean
failure) — none hangs; every group record is `dissolved`; no worker is left in a group, running or
holding KV; and requests submitted after the load are all admitted (no 503 wedge) and exact.
"""
from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from migrate_cluster import PROMPT, MigrationCluster, Stream, migration_cluster
from service_procs import wait_ready
from services.gpu_worker.engine.engine import LLMEngine
from shared.bus import Bus
from shared.events import StreamError, TokenChunk, WorkerStats
from shared.events.common import GroupMember
from shared.events.dispatch import SubmitAccepted, SubmitReply, SubmitRequest
from shared.events.plan import DissolveGroup, DropInstanceLayers, FormGroup, PlanApplied, RestoreInstanceLayers
from shared.subjects import dispatch_submit, request_out, worker_stats
from test_buddy_group_faults import group_state, planner_applies
from test_buddy_group_restore import members
from services.gpu_worker.instance import engine_params
from shared.events import SamplingParams

pytestmark = pytest.mark.timeout(600)
IN_FLIGHT = 4  # requests kept in flight while the groups change
SAMPLING = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPTS = [PROMPT + [3 + i, 50 + 7 * i] * (1 + i % 3) for i in range(12)]  # (the references: one run each)
# (the member killed, or None: restore and dissolve under load; the group's entry first)
CYCLES: list[tuple[str | None, tuple[str, str]]] = [("w1", ("w0", "w1")), (None, ("w1", "w0")), ("w0", ("w1", "w0"))]
STREAM_END_S = 180.0  # a stream still open this long after the load stopped hangs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with migration_cluster(tmp_path_factory.mktemp("buddy-chaos"), ("w0", "w1"), max_context=2048,
                           step_token_budget=64, services=("dispatcher",)) as running:
        yield running


@dataclass
class Load:
    """Requests through the dispatcher, `IN_FLIGHT` at a time until `stop` is set."""

    bus: Bus
    streams: dict[str, tuple[list[int], Stream]] = field(default_factory=dict)
    refused: dict[str, SubmitReply] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    async def submit(self, rid: str, prompt: list[int]) -> Stream | None:
        stream = Stream()
        await self.bus.subscribe(request_out(rid), TokenChunk | StreamError, stream.on)
        reply = await self.bus.request(dispatch_submit(), SubmitRequest(
            request_id=rid, model="tiny", prompt_token_ids=prompt, sampling=SAMPLING, arrival_ts=time.time()),
            SubmitReply, timeout=10)
        if not isinstance(reply, SubmitAccepted):
            self.refused[rid] = reply
            return None
        self.streams[rid] = (prompt, stream)
        return stream

    async def client(self) -> None:
        while not self.stop.is_set():
            i = next(self._ids)
            stream = await self.submit(f"chaos-{i}", PROMPTS[i % len(PROMPTS)])
            if stream is None:
                await asyncio.sleep(0.5)  # refused while the cluster changes: come back
                continue
            done = asyncio.ensure_future(stream.done.wait())
            stopped = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
            done.cancel(), stopped.cancel()


_EXPECTED: dict[tuple[int, ...], list[int]] = {}


def expected(reference: LLMEngine, prompt: list[int]) -> list[int]:
    """The tokens of an unsplit run of `prompt`."""
    key = tuple(prompt)
    if key not in _EXPECTED:
        _EXPECTED[key] = reference.generate([prompt], engine_params(SAMPLING))[0].token_ids
    return _EXPECTED[key]


def outcome(stream: Stream, want: list[int]) -> str:
    """`exact`, `failed` (ended by a StreamError), or what is wrong with it."""
    if stream.errors:
        return "failed"
    by_seq: dict[int, TokenChunk] = {}
    for c in stream.chunks:
        by_seq.setdefault(c.seq, c)  # a chunk delivered again: the first counts
    seqs = sorted(by_seq)
    if seqs != list(range(len(seqs))):
        return f"gap: seqs {seqs}"
    got = [t for s in seqs for t in by_seq[s].token_ids]
    return "exact" if got == want else f"wrong tokens: {got} != {want}"


async def dissolve(bus: Bus, group: str) -> None:
    """The planner's DissolveGroup, retried as it would be (each interval) until it applies."""
    for attempt in range(240):
        if isinstance(await planner_applies(bus, f"p-{group}-dissolve-{attempt}", DissolveGroup(group_id=group)),
                      PlanApplied):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{group} never dissolved (LeaveGroup refused for 2 minutes)")


async def form(bus: Bus, group: str, ms: list[GroupMember]) -> None:
    formed = await planner_applies(bus, f"p-{group}-form", FormGroup(group_id=group, model="tiny", members=ms))
    assert isinstance(formed, PlanApplied), formed
    for m, other in zip(ms, reversed(ms)):
        dropped = await planner_applies(bus, f"p-{group}-drop-{m.worker_id}", DropInstanceLayers(
            worker_id=m.worker_id, instance_id=m.instance_id, group_id=group, layers=other.layers))
        assert isinstance(dropped, PlanApplied), dropped


async def restore(bus: Bus, group: str, ms: list[GroupMember]) -> None:
    for m, other in zip(ms, reversed(ms)):
        restored = await planner_applies(bus, f"p-{group}-restore-{m.worker_id}", RestoreInstanceLayers(
            worker_id=m.worker_id, instance_id=m.instance_id, layers=other.layers))
        assert isinstance(restored, PlanApplied), restored


async def settled(bus: Bus, workers: tuple[str, ...], timeout: float = 60.0) -> dict[str, WorkerStats]:
    """Until every worker's stats show its instance in no group, idle, holding no KV."""
    latest: dict[str, WorkerStats] = {}

    async def on_stats(st: WorkerStats, _ctx: object) -> None:
        latest[st.worker_id] = st

    sub = await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if set(latest) >= set(workers) and all(
                    i.group_id is None and i.running == 0 and i.waiting == 0 and i.kv_blocks_used == 0
                    for st in latest.values() for i in st.instances):
                return latest
            await asyncio.sleep(0.1)
        raise AssertionError(f"workers not settled: {[(w, st.instances) for w, st in latest.items()]}")
    finally:
        await sub.unsubscribe()


async def test_groups_formed_killed_and_dissolved_under_load_lose_no_stream(
        bus: Bus, reference: LLMEngine, cluster: MigrationCluster) -> None:
    t0 = time.monotonic()
    load = Load(bus)
    clients = [asyncio.ensure_future(load.client()) for _ in range(IN_FLIGHT)]
    try:
        for n, (victim, order) in enumerate(CYCLES):
            group = f"chaos-g{n}"
            print(f"{time.monotonic() - t0:6.1f}s cycle {n}: {victim or 'restore'}", flush=True)
            ms = members(*order)
            await form(bus, group, ms)
            await asyncio.sleep(2.0)  # requests run through both stages, victims exchange their KV
            if victim is not None:
                cluster.procs[victim].stop(signal.SIGKILL)
                cluster.procs[victim].start()  # as `tidal up` does
                await dissolve(bus, group)  # the survivor collapsed: its LeaveGroup is answered
                await wait_ready(bus, cluster.procs[victim], timeout=120)
            else:
                await restore(bus, group, ms)  # the owners migrate their requests back, then leave
                await dissolve(bus, group)
            assert await group_state(bus, group) == "dissolved", group
    finally:
        load.stop.set()
        await asyncio.gather(*clients, return_exceptions=True)

    print(f"{time.monotonic() - t0:6.1f}s load stopped: {len(load.streams)} streams", flush=True)
    deadline = time.monotonic() + STREAM_END_S
    for rid, (_prompt, stream) in load.streams.items():
        try:
            await asyncio.wait_for(stream.done.wait(), max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise AssertionError(f"{rid} hangs: {len(stream.chunks)} chunks, no end") from None
    outcomes = {rid: outcome(stream, expected(reference, prompt))
                for rid, (prompt, stream) in load.streams.items()}
    wrong = {rid: o for rid, o in outcomes.items() if o not in ("exact", "failed")}
    assert not wrong, wrong
    assert sum(o == "exact" for o in outcomes.values()) >= len(outcomes) // 2, outcomes
    assert len(load.streams) >= IN_FLIGHT * len(CYCLES), (len(load.streams), load.refused)

    await settled(bus, ("w0", "w1"))  # no group, no request, no KV left anywhere
    print(f"{time.monotonic() - t0:6.1f}s settled: {sorted(outcomes.values())}", flush=True)
    after = Load(bus)
    fresh = [(f"after-{i}", PROMPTS[i]) for i in range(6)]
    for rid, prompt in fresh:  # the load is over: every request is admitted (no 503 wedge) ...
        assert await after.submit(rid, prompt) is not None, after.refused
    for rid, prompt in fresh:  # ... and served exactly
        stream = after.streams[rid][1]
        await asyncio.wait_for(stream.done.wait(), 120)
        assert outcome(stream, expected(reference, prompt)) == "exact", rid
