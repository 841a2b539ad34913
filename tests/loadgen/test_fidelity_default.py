"""`tidal bench fidelity --default-cluster`: which workers ran the model's requests, read from the
workers' stats as the bus delivers them (tidal/bench/fidelity_default.py; the run itself needs a
loaded cluster for minutes and is documented in docs/running-real-models.md)."""
from __future__ import annotations

import asyncio

from shared.events import WorkerState, WorkerStats
from shared.events.common import LayerRange
from shared.events.worker import InstanceStats, PoolBreakdown
from tidal.bench.fidelity_default import ServingWatch


def stats(worker: str, ts: float, *loads: tuple[str, int, int]) -> WorkerStats:
    return WorkerStats(worker_id=worker, seq=1, ts=ts, device="cpu", state=WorkerState.READY,
                       pool=PoolBreakdown(capacity_bytes=1 << 20),
                       instances=[InstanceStats(instance_id=f"{worker}-{m}", model=m, layers=LayerRange(start=0, end=2),
                                                running=r, waiting=w) for m, r, w in loads])


def test_the_watch_names_the_workers_that_ran_the_model_and_from_when() -> None:
    watch = ServingWatch("m")
    feed = [stats("cpu-0", 99.0, ("m", 0, 0), ("other", 3, 0)), stats("cpu-1", 99.5, ("other", 0, 0))]
    for msg in feed:  # before the run: the instances serving at the start
        asyncio.run(watch._on_stats(msg, None))
    assert watch.at_start == {"cpu-0"}
    watch.t0_unix = 100.0
    for msg in [stats("cpu-0", 101.0, ("m", 2, 3)), stats("cpu-1", 102.0, ("other", 5, 0)),
                stats("cpu-1", 104.5, ("m", 1, 0)), stats("cpu-0", 105.0, ("m", 4, 0))]:
        asyncio.run(watch._on_stats(msg, None))
    assert watch.first == {"cpu-0": 1.0, "cpu-1": 4.5}  # the other model's requests do not count
    assert watch.peak == {"cpu-0": 5, "cpu-1": 1}
    assert watch.line() == "cpu-0 (from 1.0 s, peak 5), cpu-1 (from 4.5 s, peak 1)"


def test_a_busy_peer_engine_reports_ready_keeps_stepping_and_stops_when_its_stdin_closes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The stand-in for the cluster's other workers while the profile is measured (loadgen/profiler/busy_peer.py):
    a real engine, busy until told to stop."""
    import subprocess
    import sys
    import time

    from services.gpu_worker.engine.checkpoint_gen import make_model

    model = make_model(tmp_path / "m", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=1)
    peer = subprocess.Popen([sys.executable, "-m", "loadgen.profiler.busy_peer", str(model), "1", str(64 << 20), "8",
                             "256", "512"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
        with open(f"/proc/{peer.pid}/stat") as f:
            before = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])  # utime + stime, in ticks
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # it burns CPU while it stands in for a busy worker
            with open(f"/proc/{peer.pid}/stat") as f:
                if sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) > before + 50:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("the peer used no CPU after it said ready")
        assert peer.stdin is not None
        peer.stdin.close()
        assert peer.wait(timeout=120) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
