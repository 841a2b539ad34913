"""The planner live: a real nats-server, registry, dispatcher, planner and three gpu_worker processes.

Fragmented load (long and short requests the dispatcher spread over the workers) is consolidated
by planner-issued migrations, every stream token-exact against the fault-free run (greedy, and
seeded sampling), and a worker left empty is reported idle; two planners: one decides, the other
takes over when it dies;
a destination killed mid-migration loses no request. The tests run in this order on one cluster."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from e2e.assets import LLAMA, Oracle
from e2e.cluster import ClusterSpec, E2ECluster
from e2e.observer import Observer
from service_procs import ROOT, ServiceProcess
from shared.bus import Bus, BusSettings, Delivery
from shared.events import SamplingParams, SubmitAccepted, SubmitReply, SubmitRequest
from shared.events.plan import Migrate, PlanApplied, PlanCancelled, PlanDecided, PlanEvent, PlanFailed, ReportIdle
from shared.events.registry import Bucket, LeaseRecord
from shared.registry_client import RegistryClient
from shared.subjects import CATALOG, dispatch_submit

pytestmark = pytest.mark.timeout(300)

CLUSTER_SPEC = ClusterSpec(
    workers={"w0": [LLAMA], "w1": [LLAMA], "w2": [LLAMA]}, gateway=False, control_plane=True, migration="tokens",
    extra_toml='[planner]\ninterval = "300ms"\nlease_ttl = "1s"\nctl_timeout = "20s"\nconsolidate = "on"\n'
               # least-load spreads, MELL packs; the moves are what is tested, not MELL's compute gate (its own tests):
               # a relative TPOT SLO's base from a quiet moment held every move on a loaded box (CI)
               '[slo]\ntpot = "60s"\n',
    # the tiny model steps in ~0.2 ms: 700 tokens would end before a planner interval saw them
    worker_toml='min_step_time = "10ms"\n',
)
LONG, SHORT = 700, 40


class Plans:
    """Every plan event, in arrival order."""

    def __init__(self) -> None:
        self.events: list[PlanDecided | PlanApplied | PlanFailed | PlanCancelled] = []
        self.on_decided = None

    async def on(self, msg: PlanDecided | PlanApplied | PlanFailed | PlanCancelled, _ctx: Delivery) -> None:
        self.events.append(msg)
        if isinstance(msg, PlanDecided) and self.on_decided is not None:
            self.on_decided(msg)

    def decided(self, action_type: type) -> list[PlanDecided]:
        return [e for e in self.events if isinstance(e, PlanDecided) and isinstance(e.plan.actions[0], action_type)]

    def outcome(self, plan_id: str) -> list[object]:
        return [e for e in self.events if not isinstance(e, PlanDecided) and e.plan_id == plan_id]


@pytest.fixture
async def bus(cluster: E2ECluster):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="cli")
    yield bus
    await bus.close()


@pytest.fixture
async def plans(bus: Bus) -> Plans:
    seen = Plans()
    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, seen.on)
    return seen


async def submit(bus: Bus, oracle: Oracle, rid: str, prompt: str, max_tokens: int) -> None:
    msg = SubmitRequest(request_id=rid, model=LLAMA, prompt_token_ids=oracle.prompt_ids(LLAMA, prompt),
                        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens), arrival_ts=time.time())
    reply = await bus.request(dispatch_submit(), msg, SubmitReply)
    assert isinstance(reply, SubmitAccepted), reply


def assert_exact(observer: Observer, oracle: Oracle, rid: str, prompt: str, max_tokens: int) -> None:
    chunks = sorted(observer.chunks(rid), key=lambda c: c.seq)
    assert [c.seq for c in chunks] == list(range(len(chunks))), f"{rid}: a gap or a duplicate"
    tokens = tuple(t for c in chunks for t in c.token_ids)
    assert tokens == oracle.greedy(LLAMA, prompt=prompt, max_tokens=max_tokens).token_ids, rid


async def run_load(bus: Bus, observer: Observer, oracle: Oracle, tag: str,
                   sizes: list[int]) -> dict[str, tuple[str, int]]:
    prompts = oracle.long_prompts(LLAMA, len(sizes), LONG)
    load = {f"{tag}-{i}": (prompts[i], n) for i, n in enumerate(sizes)}
    for rid, (prompt, n) in load.items():
        await submit(bus, oracle, rid, prompt, n)
    return load


async def finished(observer: Observer, rids: list[str], timeout: float = 180.0) -> None:
    await observer.wait_for(lambda: all(any(c.final for c in observer.chunks(r)) for r in rids), timeout=timeout)


async def test_fragmented_load_is_consolidated_by_planner_migrations(bus: Bus, plans: Plans, observer: Observer,
                                                                     oracle: Oracle) -> None:
    load = await run_load(bus, observer, oracle, "frag", [LONG, SHORT, LONG, SHORT, LONG, SHORT])
    await finished(observer, list(load))
    first = {rid: observer.workers(rid)[0] for rid in load}
    assert len(set(first.values())) >= 2, f"the dispatcher did not spread the load: {first}"
    for rid, (prompt, n) in load.items():
        assert_exact(observer, oracle, rid, prompt, n)
    moved = [rid for rid in load if len(observer.workers(rid)) > 1]
    assert moved, "no request was migrated"
    migrations = {d.plan.plan_id: d.plan.actions[0] for d in plans.decided(Migrate)}
    applied = [pid for pid in migrations if any(isinstance(e, PlanApplied) for e in plans.outcome(pid))]
    assert applied and {migrations[p].request_id for p in applied} <= set(moved) | set(load)
    sources = {migrations[p].source for p in applied}
    await observer.wait_for(lambda: any(isinstance(d.plan.actions[0], ReportIdle)
                                        and d.plan.actions[0].worker_id in sources
                                        for d in plans.decided(ReportIdle)), timeout=10)
    for pid in migrations:  # every decided effect ends exactly once
        await observer.wait_for(lambda pid=pid: plans.outcome(pid), timeout=30)
        assert len(plans.outcome(pid)) == 1


async def test_seeded_sampling_is_token_exact_through_planner_migrations(bus: Bus, plans: Plans, observer: Observer,
                                                                        oracle: Oracle) -> None:
    """Seeded sampling is a function of (seed, output index): a request the planner moved samples the
    tokens an unmoved run samples."""
    from services.gpu_worker.engine.sampling_params import SamplingParams as EngineSampling

    sizes = [LONG, SHORT, LONG, SHORT, LONG, SHORT]
    prompts = oracle.long_prompts(LLAMA, len(sizes), LONG)
    load = {f"seeded-{i}": (prompts[i], n, 1000 + i) for i, n in enumerate(sizes)}
    for rid, (prompt, n, seed) in load.items():
        msg = SubmitRequest(request_id=rid, model=LLAMA, prompt_token_ids=oracle.prompt_ids(LLAMA, prompt),
                            sampling=SamplingParams(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True),
                            arrival_ts=time.time())
        assert isinstance(await bus.request(dispatch_submit(), msg, SubmitReply), SubmitAccepted)
    await finished(observer, list(load))
    moved = [rid for rid in load if len(observer.workers(rid)) > 1]
    assert moved, "no seeded request was migrated"
    engine = oracle._engine(LLAMA)
    for rid, (prompt, n, seed) in load.items():
        chunks = sorted(observer.chunks(rid), key=lambda c: c.seq)
        assert [c.seq for c in chunks] == list(range(len(chunks))), f"{rid}: a gap or a duplicate"
        (want,) = engine.generate([oracle.prompt_ids(LLAMA, prompt)],
                                  EngineSampling(temperature=0.8, seed=seed, max_tokens=n, ignore_eos=True))
        assert tuple(t for c in chunks for t in c.token_ids) == tuple(want.token_ids), rid

    def applied() -> set[str]:
        return {d.plan.actions[0].request_id for d in plans.decided(Migrate)
                if any(isinstance(e, PlanApplied) for e in plans.outcome(d.plan.plan_id))}

    await observer.wait_for(lambda: set(moved) <= applied(), timeout=10)  # every move was a planner's


async def test_two_planners_one_decides_and_the_other_takes_over(cluster: E2ECluster, bus: Bus, plans: Plans,
                                                                  observer: Observer) -> None:
    registry = RegistryClient(bus)
    standby = ServiceProcess("planner", cluster.nats_url, cluster.config, "planner-b").start()
    cluster.procs["planner-b"] = standby
    await asyncio.sleep(3.0)  # the standby has run several intervals
    lease = await registry.get(Bucket.LEASES, "planner")
    assert lease is not None and isinstance(lease.record, LeaseRecord) and lease.record.holder == "planner-e2e"
    prefixes = {d.plan.plan_id.rsplit("-", 1)[0] for d in plans.events if isinstance(d, PlanDecided)}
    assert len(prefixes) <= 1  # only the leader decided
    term = lease.record.term
    cluster.kill("planner")  # the leader dies without releasing the lease

    async def holder() -> str:
        entry = await registry.get(Bucket.LEASES, "planner")
        return entry.record.holder if entry is not None else ""

    deadline = time.monotonic() + 15
    while await holder() != "planner-b":
        assert time.monotonic() < deadline, "the standby did not take over"
        await asyncio.sleep(0.2)
    entry = await registry.get(Bucket.LEASES, "planner")
    assert entry is not None and entry.record.term == term + 1
    # the new leader decides (its first step reports the idle workers again, under its own ids)
    await observer.wait_for(lambda: {d.plan.plan_id.rsplit("-", 1)[0] for d in plans.decided(ReportIdle)}, timeout=10)


async def test_a_destination_killed_mid_migration_loses_no_request(cluster: E2ECluster, bus: Bus, plans: Plans,
                                                                   observer: Observer, oracle: Oracle) -> None:
    killed: list[str] = []

    def kill_destination(decided: PlanDecided) -> None:
        action = decided.plan.actions[0]
        if isinstance(action, Migrate) and not killed:
            killed.append(action.destination)
            os.killpg(cluster.procs[action.destination].pid, signal.SIGKILL)

    plans.on_decided = kill_destination
    load = await run_load(bus, observer, oracle, "kill", [LONG, LONG, LONG, LONG])
    await finished(observer, list(load))
    assert killed, "no migration was decided"
    for rid, (prompt, n) in load.items():
        assert_exact(observer, oracle, rid, prompt, n)


async def test_the_external_scheduler_example_sees_the_cluster(cluster: E2ECluster, bus: Bus, observer: Observer,
                                                               oracle: Oracle) -> None:
    load = await run_load(bus, observer, oracle, "ext", [LONG, LONG])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "external_scheduler.py"), "--nats", cluster.nats_url,
        "--duration", "3", "--dry-run", cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    live = {w for w in CLUSTER_SPEC.workers if cluster.alive(w)}
    assert {line.split()[1] for line in text.splitlines() if line.startswith("worker ")} == live, text
    await finished(observer, list(load))
