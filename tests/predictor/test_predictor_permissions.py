"""The predictor keeps its history in JetStream as its own NATS user (compose/nats.conf's permissions)."""
from __future__ import annotations

import time

import pytest

from service_procs import ServiceProcess, eventually, wait_ready, write_config
from services.predictor.windows import OpenWindows
from shared.events import DispatchStats, ModelLoad
from shared.events.worker import InstanceStats, LayerRange, PoolBreakdown, WorkerState, WorkerStats
from shared.bus import Bus, BusSettings
from shared.nats_permissions import password_variable, render_authorization
from shared.nats_server import NatsServer
from shared.subjects import PREDICTOR_BUCKET, ROLES, dispatch_stats, worker_stats

pytestmark = pytest.mark.timeout(90)

CONFIG = """
[cluster]
data_dir = "data"

[predictor]
window = "1s"
season = "4s"
peak_slot = "500ms"
"""


async def test_predictor_opens_its_bucket_with_its_own_user(tmp_path, monkeypatch):
    for role in ROLES:
        monkeypatch.setenv(password_variable(role), f"pw-{role}")
    server = NatsServer(store_dir=tmp_path / "nats", extra_config=render_authorization()).start()
    predictor = ServiceProcess("predictor", f"nats://predictor:pw-predictor@127.0.0.1:{server.port}",
                               write_config(tmp_path, CONFIG), "predictor-perm")
    cli = await Bus.connect(BusSettings(url=f"nats://cli:pw-cli@127.0.0.1:{server.port}"), service="cli")
    try:
        predictor.start()
        await wait_ready(cli, predictor)
        admin = await Bus.connect(BusSettings(url=f"nats://registry:pw-registry@127.0.0.1:{server.port}"),
                                  service="registry")
        dispatcher = await Bus.connect(BusSettings(url=f"nats://dispatcher:pw-dispatcher@127.0.0.1:{server.port}"),
                                       service="dispatcher")
        worker = await Bus.connect(BusSettings(url=f"nats://gpu_worker:pw-gpu_worker@127.0.0.1:{server.port}"),
                                   service="gpu_worker")
        try:
            bucket = await admin.kv(PREDICTOR_BUCKET, OpenWindows, create=False)  # created by the predictor

            async def stored():
                # sent until seen: the windows are 1 s, so one message may land in a window that closes first
                now = time.time()
                await dispatcher.publish(dispatch_stats(), DispatchStats(
                    dispatcher_id="dispatcher-x", ts=now, interval_s=0.25, models=[ModelLoad(model="m", admitted=3)]))
                await worker.publish(worker_stats(), WorkerStats(
                    worker_id="w-x", seq=0, ts=now, device="cpu", state=WorkerState.READY,
                    pool=PoolBreakdown(capacity_bytes=1 << 20),
                    instances=[InstanceStats(instance_id="i", model="m", layers=LayerRange(start=0, end=1), running=2)]))
                entry = await bucket.get("open")
                return entry is not None and any(entry.value.windows.values()) and any(
                    "w:w-x" in per for slots in entry.value.samples.values() for per in slots.values())

            await eventually(stored, timeout=10)  # the predictor heard both and wrote its open windows
        finally:
            await admin.close()
            await dispatcher.close()
            await worker.close()
        assert predictor.stop() == 0
        assert "permissions violation" not in predictor.log().lower(), predictor.log()[-2000:]
    finally:
        await cli.close()
        predictor.stop()
        server.stop()
