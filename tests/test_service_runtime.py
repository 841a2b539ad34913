"""The service runtime as a real process: health, /metrics over HTTP, SIGTERM drain, escalation."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.bus import Bus, BusSettings
from shared.health import HealthReply, HealthRequest, health_subject
from shared.service import parse_settings
from shared.wire import DeadlineExceeded, NoResponders, RemoteError
from slow_service import SERVICE, WORK_SUBJECT, SlowWork, WorkDone

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "slow_service.py"
DRAIN_DEADLINE_S = 5.0


def start_service(nats_url: str, log_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(SCRIPT), "--nats", nats_url, "--instance", "slow-1", "--metrics-port", "0",
            "--drain-timeout", str(DRAIN_DEADLINE_S), *extra]
    with open(log_dir / "service.log", "ab") as log:
        return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def health(bus: Bus) -> HealthReply | None:
    try:
        return await bus.request(health_subject(SERVICE), HealthRequest(), HealthReply, timeout=0.5)
    except (NoResponders, DeadlineExceeded):
        return None


async def wait_for(bus: Bus, check, timeout_s: float = 30.0) -> HealthReply:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        reply = await health(bus)
        if reply is not None and check(reply):
            return reply
        await asyncio.sleep(0.05)
    raise AssertionError("service did not reach the expected health in time")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture
async def client(nats_url):
    bus = await Bus.connect(BusSettings(url=nats_url), service="test-client")
    yield bus
    await bus.close()


async def test_health_and_metrics_endpoint(nats_url, client, tmp_path) -> None:
    proc = start_service(nats_url, tmp_path)
    try:
        ready = await wait_for(client, lambda h: h.state == "ready")
        assert (ready.service, ready.instance, ready.version) == (SERVICE, "slow-1", "test-1")
        assert ready.metrics_port and ready.uptime_s >= 0
        assert await client.request(WORK_SUBJECT, SlowWork(n=7, seconds=0), WorkDone) == WorkDone(n=7)
        url = f"http://127.0.0.1:{ready.metrics_port}/metrics"
        body = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()
        assert f'tidal_handle_seconds_count{{service="{SERVICE}",subject="{WORK_SUBJECT}"}} 1.0' in body
        assert "process_cpu_seconds_total" in body
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stop(proc)


async def test_sigterm_drains_in_flight_work_and_exits_zero(nats_url, client, tmp_path) -> None:
    proc = start_service(nats_url, tmp_path)
    try:
        await wait_for(client, lambda h: h.state == "ready")
        in_flight = [
            asyncio.ensure_future(client.request(WORK_SUBJECT, SlowWork(n=i, seconds=1.0), WorkDone, timeout=15))
            for i in range(5)
        ]
        await wait_for(client, lambda h: h.inflight == 5, timeout_s=5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await wait_for(client, lambda h: h.state == "draining", timeout_s=5)
        await asyncio.sleep(0.2)
        with pytest.raises((NoResponders, DeadlineExceeded, RemoteError)):  # new work is refused, not taken
            await client.request(WORK_SUBJECT, SlowWork(n=99, seconds=0), WorkDone, timeout=0.5)
        replies = await asyncio.gather(*in_flight)
        assert sorted(r.n for r in replies) == [0, 1, 2, 3, 4]  # every in-flight request got its reply
        code = await asyncio.to_thread(proc.wait, DRAIN_DEADLINE_S + 5)
        assert code == 0
        assert time.monotonic() - signalled < DRAIN_DEADLINE_S  # done when the work was, not at the deadline
    finally:
        stop(proc)


async def test_work_longer_than_the_drain_deadline_is_abandoned_at_the_deadline(nats_url, client, tmp_path) -> None:
    proc = start_service(nats_url, tmp_path, "--drain-timeout", "1")
    try:
        await wait_for(client, lambda h: h.state == "ready")
        stuck = asyncio.ensure_future(client.request(WORK_SUBJECT, SlowWork(n=1, seconds=60), WorkDone, timeout=15))
        await wait_for(client, lambda h: h.inflight == 1, timeout_s=5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
        assert time.monotonic() - signalled < 4.0  # the 1 s drain deadline, not the 60 s of work
        assert "drain cut short" in (tmp_path / "service.log").read_text()
        stuck.cancel()
    finally:
        stop(proc)


async def test_a_second_signal_cuts_the_drain_short(nats_url, client, tmp_path) -> None:
    proc = start_service(nats_url, tmp_path)  # drain deadline 5 s
    try:
        await wait_for(client, lambda h: h.state == "ready")
        stuck = asyncio.ensure_future(client.request(WORK_SUBJECT, SlowWork(n=1, seconds=60), WorkDone, timeout=15))
        await wait_for(client, lambda h: h.inflight == 1, timeout_s=5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await wait_for(client, lambda h: h.state == "draining", timeout_s=5)
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 15) == 0
        assert time.monotonic() - signalled < DRAIN_DEADLINE_S - 1
        stuck.cancel()
    finally:
        stop(proc)


async def test_escalated_task_stops_the_service_with_a_failure_code(nats_url, client, tmp_path) -> None:
    proc = start_service(nats_url, tmp_path, "--crash")
    try:
        assert await asyncio.to_thread(proc.wait, 30) == 1
        assert "the background task died" in (tmp_path / "service.log").read_text()
    finally:
        stop(proc)


def test_common_options_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TIDAL_NATS_URL", "nats://10.0.0.1:4222")
    monkeypatch.setenv("TIDAL_METRICS_PORT", "9100")
    monkeypatch.setenv("TIDAL_INSTANCE_ID", "disp-7")
    settings = parse_settings("dispatcher", [])
    assert (settings.nats_url, settings.metrics_port, settings.instance) == ("nats://10.0.0.1:4222", 9100, "disp-7")
    assert parse_settings("dispatcher", ["--nats", "nats://h:1", "--drain-timeout", "2"]).drain_timeout_s == 2.0
    assert health_subject("dispatcher") == "tidal.v1.dispatcher.health"
    with pytest.raises(ValueError):
        health_subject("bad.name")
