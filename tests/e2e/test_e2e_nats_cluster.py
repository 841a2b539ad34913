"""NATS as users run it at scale (compose): three nats-server nodes, the registry's buckets replicated on
all three (`[registry] replicas = 3`). One node — the one every service is connected to, and the
leader of the registry's buckets — is killed (SIGKILL) while requests stream and registry entries
are written: every acknowledged entry is still there, every request admitted completes with all its
tokens (one the gateway could not hand on while reconnecting is refused with 503 and served when
resent), every service answers again without being restarted (they reconnect to the other nodes), and the
planner keeps its lease (renewed through the node's death: one planner goes on deciding plans).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import pytest

from e2e.assets import LLAMA, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster, WorkerProcess
from e2e.nats_cluster import NatsCluster, move_leader, stream_leader
from loadgen.runner.runner import LoadRunner, RunnerConfig
from loadgen.traces.schema import TraceRecord
from service_procs import ServiceProcess
from shared.bus import Bus, BusSettings
from shared.events.registry import Bucket, ModelRecord
from shared.registry_client import RegistryClient
from shared.subjects import kv_bucket
from shared.wire import DeadlineExceeded, TidalError
from tidal.health_probe import gather_health

pytestmark = pytest.mark.timeout(300)

SPEC = ClusterSpec(workers={"w0": [LLAMA]}, max_batch=8, queue_bound=64)
REPLICATED = {"TIDAL__REGISTRY__REPLICAS": "3"}
SEED = "n0"  # the node every service connects to first (it tells them of the others)


class ClusteredE2E(E2ECluster):
    """The e2e cluster's services on a three-node NATS cluster instead of one nats-server."""

    def __init__(self, root: Path, assets: TinyAssets) -> None:
        super().__init__(root, SPEC, assets)
        self.nats_nodes = NatsCluster(root / "nats")

    @property
    def nats_url(self) -> str:
        return self.nats_nodes.url_of(SEED)

    def start(self, timeout: float = 120.0) -> "ClusteredE2E":
        from e2e.cluster import cluster_toml

        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(cluster_toml(self.spec, self.assets, self.root / "data", self.port))
        self.nats_nodes.start()
        url = self.nats_url
        self.procs["registry"] = ServiceProcess("registry", url, self.config, "registry-e2e", env=REPLICATED).start()
        self.procs["dispatcher"] = ServiceProcess("dispatcher", url, self.config, "dispatcher-e2e").start()
        self.procs["w0"] = WorkerProcess("gpu_worker", url, self.config, "gpu_worker-w0-e2e", "--worker-id", "w0").start()
        self.procs["gateway"] = ServiceProcess("gateway", url, self.config, "gateway-e2e").start()
        self.procs["planner"] = ServiceProcess("planner", url, self.config, "planner-e2e").start()
        try:
            asyncio.run(self._wait_healthy(timeout))
            self._warm_up(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.nats = None  # E2ECluster.stop stops its single server; ours are three
        super().stop()
        self.nats_nodes.stop()


@pytest.fixture(scope="module")
def clustered(tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory):
    running = ClusteredE2E(tmp_path_factory.mktemp("nats-cluster"), tiny_assets).start()
    try:
        yield running
    finally:
        running.stop()


async def write_entries(bus: Bus, names: list[str], acked: list[str], pause_s: float) -> None:
    """Create a model record per name, retrying each (same idempotency key) until the registry acknowledges it."""
    registry = RegistryClient(bus, timeout=3.0)
    for name in names:
        record = ModelRecord(name=name, path="/nowhere", num_layers=1, max_context=64)
        deadline = time.monotonic() + 60
        while True:
            try:
                await registry.create(record, idempotency_key=f"create-{name}")
                break
            except TidalError:
                assert time.monotonic() < deadline, f"{name}: never acknowledged"
                await asyncio.sleep(0.2)
        acked.append(name)
        await asyncio.sleep(pause_s)


async def test_a_killed_node_and_leader_loses_no_entry_or_request(clustered: ClusteredE2E) -> None:
    buckets = [f"KV_{kv_bucket(b)}" for b in (Bucket.MODELS, Bucket.WORKERS, Bucket.SERVICES, Bucket.LEASES)]
    admin = await nats.connect(clustered.nats_nodes.url_of("n1"))  # not on the node that dies
    try:
        for stream in buckets:  # replicated on every node; the seed node leads them
            info = await admin.jetstream().stream_info(stream)
            assert info.config.num_replicas == 3, (stream, info.config)
            await move_leader(admin, stream, SEED)
    finally:
        await admin.close()

    trace = [TraceRecord(arrival_s=i * 0.25, model=LLAMA, prompt_tokens=16, output_tokens=48, request_id=f"r{i}")
             for i in range(24)]
    bus = await Bus.connect(BusSettings(url=clustered.nats_url), service="cli")
    acked: list[str] = []
    try:
        before = [f"before-{i}" for i in range(5)]
        await write_entries(bus, before, acked, 0.0)
        lease = await RegistryClient(bus, timeout=5.0).get(Bucket.LEASES, "planner")
        assert lease is not None and lease.record.holder == "planner-e2e", lease  # type: ignore[union-attr]
        load = asyncio.ensure_future(LoadRunner(trace, RunnerConfig(url=clustered.base_url, request_timeout_s=120))
                                     .run())
        writes = asyncio.ensure_future(write_entries(bus, [f"during-{i}" for i in range(20)], acked, 0.2))
        await asyncio.sleep(2.0)
        clustered.nats_nodes.kill(SEED)  # every client's node, and the registry buckets' leader
        killed_at = time.time()
        outcome = await load
        await writes
        # every request admitted completed with every token, through the node's death; one sent while the
        # gateway was reconnecting may be refused up front (503, retry later: nothing admitted, nothing
        # streamed), and sent again as its Retry-After says, it completes
        refused = [r for r in outcome.records if r.status == "rejected"]
        assert all(r.output_tokens == 0 and "retry later" in (r.error or "") for r in refused), refused
        bad = [(r.request_id, r.status, r.output_tokens, r.error) for r in outcome.records
               if r.status != "rejected" and (r.status != "ok" or r.output_tokens != 48)]
        assert bad == [], bad
        again = [t for t in trace if t.request_id in {r.request_id for r in refused}]
        if again:
            await asyncio.sleep(1.0)
            resent = await LoadRunner([msgspec.structs.replace(t, arrival_s=0.0) for t in again],
                                      RunnerConfig(url=clustered.base_url, request_timeout_s=120)).run()
            assert [(r.status, r.output_tokens) for r in resent.records] == [("ok", 48)] * len(again)
        # every acknowledged entry is there, read through the surviving nodes
        registry = RegistryClient(bus, timeout=5.0)
        listed = {e.key for e in await registry.list(Bucket.MODELS)}
        assert set(acked) <= listed and len(acked) == 25, sorted(set(acked) - listed)
        # the services reconnected on their own: all answer health, none was restarted
        for name, proc in clustered.procs.items():
            assert proc.proc is not None and proc.proc.poll() is None, f"{name} exited"
        admin = await nats.connect(clustered.nats_nodes.url_of("n1"))
        try:
            new_leader = await stream_leader(admin, f"KV_{kv_bucket(Bucket.MODELS)}")
        finally:
            await admin.close()
        assert new_leader != SEED
        # the planner still holds its lease (the one that decides plans), renewed after the node died
        deadline = time.monotonic() + 30
        while True:
            try:
                renewed = await registry.get(Bucket.LEASES, "planner")
            except DeadlineExceeded:  # the leases bucket may still be electing its new leader (seconds on 2 cores)
                assert time.monotonic() < deadline, "the leases bucket never answered after the node died"
                continue
            assert renewed is not None and renewed.record.holder == "planner-e2e", renewed  # type: ignore[union-attr]
            if renewed.record.renewed_ts > killed_at:  # type: ignore[union-attr]
                break
            assert time.monotonic() < deadline, (renewed, clustered.procs["planner"].log()[-3000:])
            await asyncio.sleep(0.5)
        for service, instance in (("registry", "registry-e2e"), ("dispatcher", "dispatcher-e2e"),
                                  ("gateway", "gateway-e2e"), ("gpu_worker", "gpu_worker-w0-e2e"),
                                  ("planner", "planner-e2e")):
            replies = await gather_health(bus, service, timeout=2.0, expect={instance})
            assert replies.get(instance) is not None and replies[instance].state == "ready", (service, replies)
    finally:
        await bus.close()
