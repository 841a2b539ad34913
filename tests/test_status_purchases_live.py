"""`tidal status` asks `tidal.v1.planner.purchases` on a real nats-server beside a real registry: the
lease holder's typed reply is shown; no answer (nobody subscribed, or a planner that stays silent)
is one line, never an error, and costs at most the short purchases timeout."""
from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from shared.bus import Bus, BusSettings
from shared.events.plan import PlanPurchased, PurchaseLogReply, PurchaseLogRequest, SourcePrice
from shared.nats_server import NatsServer
from shared.subjects import planner_purchases
from tidal.commands.status import PURCHASES_SHOWN, PURCHASES_TIMEOUT_S, collect
from tidal.commands.status_view import render_to_string
from service_procs import ROOT, ServiceProcess, wait_ready, write_config

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("status-purchases")
    server = NatsServer(store_dir=root / "nats").start()
    registry = ServiceProcess("registry", server.url, write_config(root), "registry-s1").start()
    try:
        yield server, registry
    finally:
        registry.stop()
        server.stop()


@pytest.fixture
async def planner_bus(cluster):
    server, registry = cluster
    bus = await Bus.connect(BusSettings(url=server.url), service="planner")
    await wait_ready(bus, registry)
    try:
        yield bus
    finally:
        await bus.close()


def log_reply() -> PurchaseLogReply:
    bought = PlanPurchased(
        purchase_id="pur-7", ts=time.time() - 3.0, scope="worker:w1", need_bytes=96 * MiB, horizon_s=20.0, waiting=3,
        reserve_request_s_per_byte=2e-8, bought_bytes=96 * MiB, price_request_s=0.35,
        prices=[SourcePrice(source="prewarm", target="w1/demo-qwen", bytes=96 * MiB, price_request_s=0.35, bought=True,
                            plan_ids=["eff-3"]),
                SourcePrice(source="scale_out", target="demo-llama", bytes=512 * MiB, price_request_s=30.0)])
    return PurchaseLogReply(planner_id="planner-lease-holder", economy="arbiter", purchases=[bought])


async def tidal_status(url: str) -> tuple[int, str, str]:
    """The real CLI in a subprocess, so this test's loop keeps answering meanwhile."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tidal", "status", "--nats", url, "--stats-window", "0", cwd=ROOT,
        env={**os.environ, "COLUMNS": "80", "TERM": "dumb"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_shows_the_purchases_the_lease_holder_answers_with(cluster, planner_bus):
    server, _registry = cluster
    asked: list[int] = []
    reply = log_reply()

    async def answer(req: PurchaseLogRequest, _ctx: object) -> PurchaseLogReply:
        asked.append(req.limit)
        return reply

    sub = await planner_bus.subscribe(planner_purchases(), PurchaseLogRequest, answer)
    try:
        report = await collect(server.url, timeout=2.0, stats_window=0.0)
        assert report.registry_reachable and report.error is None
        assert report.purchases == reply  # typed, whole
        assert asked == [PURCHASES_SHOWN]

        code, out, err = await tidal_status(server.url)
    finally:
        await sub.unsubscribe()
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert "purchases by planner-lease-holder (newest first; prices in request-seconds)" in out
    assert "s ago  worker:w1  need 96M, bought 96M; price 0.35" in out
    assert ["bought", "prewarm", "w1/demo-qwen", "96M", "0.35"] in [line.split() for line in out.splitlines()]
    assert ["not", "bought", "scale_out", "demo-llama", "512M", "30.00"] in [line.split() for line in out.splitlines()]


async def test_without_an_answering_planner_status_says_so_and_succeeds(cluster, planner_bus):
    server, _registry = cluster
    code, out, err = await tidal_status(server.url)  # nobody subscribed: no responders, at once
    assert code == 0, err
    assert "purchases: no planner answered" in out.splitlines() and "Error" not in out + err

    async def ignore(_msg: object) -> None:  # a planner that does not hold the lease
        pass

    silent = await planner_bus.nc.subscribe(planner_purchases(), cb=ignore)
    await planner_bus.nc.flush()
    try:
        started = time.monotonic()
        report = await collect(server.url, timeout=2.0, stats_window=0.0)
        took = time.monotonic() - started
    finally:
        await silent.unsubscribe()
    assert report.registry_reachable and report.purchases is None
    assert took < PURCHASES_TIMEOUT_S + 1.0, took  # the short purchases timeout, not --timeout
    assert "purchases: no planner answered" in render_to_string(report).splitlines()
