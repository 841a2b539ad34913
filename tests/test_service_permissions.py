"""The running services stay within the NATS permissions compose/ gives each of them.

A real nats-server with the generated per-role users (shared.nats_permissions); the registry,
a gpu_worker and a dispatcher each connect as their own user, register, heartbeat and drain.
A publish or subscribe outside a user's permissions shows up as a "Permissions Violation" in
that process's log and as missing records here.
"""
from __future__ import annotations

import signal

import pytest

from service_procs import ServiceProcess, eventually, wait_ready, write_config
from shared.bus import Bus, BusSettings
from shared.events.registry import Bucket
from shared.events.worker import WorkerState
from shared.nats_permissions import password_variable, render_authorization
from shared.nats_server import NatsServer
from shared.registry_client import RegistryClient
from shared.subjects import ROLES

pytestmark = pytest.mark.timeout(120)


async def test_registry_worker_and_dispatcher_work_with_their_own_nats_users(tmp_path, monkeypatch):
    for role in ROLES:
        monkeypatch.setenv(password_variable(role), f"pw-{role}")
    server = NatsServer(store_dir=tmp_path / "nats", extra_config=render_authorization()).start()
    config = write_config(tmp_path)

    def url(role: str) -> str:
        return f"nats://{role}:pw-{role}@127.0.0.1:{server.port}"

    procs = [
        ServiceProcess("registry", url("registry"), config, "registry-p1"),
        ServiceProcess("gpu_worker", url("gpu_worker"), config, "gpu_worker-w0-p1", "--worker-id", "w0"),
        ServiceProcess("dispatcher", url("dispatcher"), config, "dispatcher-p1"),
    ]
    cli = await Bus.connect(BusSettings(url=url("cli")), service="cli")
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            await wait_ready(cli, proc)
        registry = RegistryClient(cli)

        async def all_registered():
            services = {e.key: e.record.state for e in await registry.list(Bucket.SERVICES)}
            workers = {e.key: e.record.state for e in await registry.list(Bucket.WORKERS)}
            return services if workers.get("w0") == WorkerState.READY and len(services) == 3 and \
                set(services.values()) == {"ready"} else None

        services = await eventually(all_registered, timeout=15)
        assert set(services) == {"registry-p1", "gpu_worker-w0-p1", "dispatcher-p1"}
        assert procs[2].stop(signal.SIGTERM) == 0  # drains and deregisters as the dispatcher user
        assert await registry.get(Bucket.SERVICES, "dispatcher-p1") is None
        for proc in procs:
            proc.stop()
        for proc in procs:
            assert "permissions violation" not in proc.log().lower(), proc.log()[-2000:]
    finally:
        await cli.close()
        for proc in procs:
            proc.stop()
        server.stop()
