"""(a) of `tidal bench transfer`: activation latency while a bulk KV transfer runs on the same link.

Rows, all in one run, rounds alternating:

* scheduler   the data plane (express lane for activations, bulk held while one is out)
* fifo        the data plane's FIFO baseline: one lane, whole transfers in arrival order
* raw ucxx    no data plane at all: each activation is a control message + payload + 1-byte
              answer on a raw ucxx endpoint of its own, while ONE raw send of the same bulk
              runs on another endpoint (what a second endpoint gives without any scheduling)
* idle rows   the same activations with no bulk transfer (data plane, raw ucxx): the cost
              of an activation's own messages and thread hand-offs on this machine

Latency is submit -> the receiver's answer is read (data plane: the Ack after the checksum).
"Chunk time" is the bulk chunk size over the link's measured bandwidth.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Awaitable, Callable

import numpy as np

from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass, timeline
from tidal.bench.transfer_proc import ReceiverProcess
from tidal.bench.transfer_receiver import ReceiverCommand
from tidal.bench.transfer_timeline import breakdown, report

MiB = 1 << 20
IDLE_SAMPLES = 100


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class RawPeer:
    """Raw ucxx endpoints to the receiver's raw listener: (length, payload) -> 1-byte answer."""

    def __init__(self, ucxx: Any, port: int) -> None:
        self.ucxx, self.port = ucxx, port
        self.eps: list[Any] = []

    async def endpoint(self) -> Any:
        ep = await self.ucxx.create_endpoint("127.0.0.1", self.port)
        self.eps.append(ep)
        return ep

    @staticmethod
    async def round_trip(ep: Any, buf: np.ndarray, chunk: int = 0, in_flight: int = 1) -> float:
        """`buf` as one message (chunk 0) or as messages of `chunk` bytes, `in_flight` at a
        time; returns the seconds until the receiver's answer is read."""
        t0 = time.perf_counter()
        n = buf.shape[0]
        await ep.send(np.array([n, chunk], dtype=np.int64))
        if chunk:
            slots = asyncio.Semaphore(in_flight)

            async def one(offset: int) -> None:
                async with slots:
                    await ep.send(buf[offset:offset + chunk])

            await asyncio.gather(*(one(o) for o in range(0, n, chunk)))
        else:
            await ep.send(buf)
        await ep.recv(np.empty(1, dtype=np.uint8))
        return time.perf_counter() - t0

    async def close(self) -> None:
        for ep in self.eps:
            await ep.close()


async def _paced(one: Callable[[], Awaitable[float]], interval_s: float, n: int | None = None,
                 until: "asyncio.Future[Any] | None" = None) -> list[float]:
    """`one()` every `interval_s` (not overlapping), n times or until `until` is done."""
    out: list[float] = []
    while (n is None or len(out) < n) and (until is None or not until.done()):
        out.append(await one())
        await asyncio.sleep(interval_s)
    return out


async def _data_plane_round(plane: DataPlane, address: str, kv: np.ndarray, act: np.ndarray,
                            interval_s: float) -> tuple[list[float], set[int], int, float]:
    """Activations every `interval_s` while `kv` is in flight: latencies, their ids, the KV id, KV seconds."""
    link = await plane.link("bench-receiver", address)
    bulk = await link.submit(kv, kind=TrafficClass.KV, key="kv")
    handles = []
    while not bulk.done():
        handles.append(await link.submit(act, kind=TrafficClass.ACTIVATION, key="act"))
        await asyncio.sleep(interval_s)
    kv_receipt = await bulk.wait(600)
    latencies = [(await h.wait(600)).seconds for h in handles]
    return latencies, {h.transfer_id for h in handles}, bulk.transfer_id, kv_receipt.seconds


async def _raw_round(raw: RawPeer, bulk_ep: Any, act_ep: Any, kv: np.ndarray, act: np.ndarray,
                     interval_s: float) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    bulk = asyncio.ensure_future(raw.round_trip(bulk_ep, kv))
    latencies = await _paced(lambda: raw.round_trip(act_ep, act), interval_s, until=bulk)
    await bulk
    return latencies, time.perf_counter() - t0


async def bench_activation_latency(args: argparse.Namespace, rx: ReceiverProcess, chunking: ChunkingConfig,
                                   load: Callable[[], str]) -> None:
    kv = np.ones(args.size_mib * MiB, dtype=np.uint8)
    act = np.ones(args.activation_kib << 10, dtype=np.uint8)
    interval = args.interval_ms / 1000
    sched = DataPlane("bench-sched", config=DataPlaneConfig(chunking=chunking))
    fifo = DataPlane("bench-fifo", config=DataPlaneConfig(chunking=ChunkingConfig(fifo=True)))
    address = rx.ready.address
    link = await sched.link("bench-receiver", address)
    flink = await fifo.link("bench-receiver", address)
    await link.send(kv[: 64 * MiB], kind=TrafficClass.KV, key="warmup")  # the link measures its bandwidth
    await flink.send(kv[: 64 * MiB], kind=TrafficClass.KV, key="warmup")
    raw = RawPeer(sched._runtime(), rx.ready.raw_port)
    raw_bulk, raw_act = await raw.endpoint(), await raw.endpoint()
    await raw.round_trip(raw_bulk, kv[: 64 * MiB])

    async def plane_act() -> float:
        return (await link.send(act, kind=TrafficClass.ACTIVATION, key="act", timeout=60)).seconds

    idle = {"idle, data plane": await _paced(plane_act, interval, IDLE_SAMPLES),
            "idle, raw ucxx": await _paced(lambda: raw.round_trip(raw_act, act), interval, IDLE_SAMPLES)}
    rows: dict[str, list[float]] = {"scheduler": [], "fifo": [], "raw ucxx": []}
    kv_s: dict[str, list[float]] = {name: [] for name in rows}
    traced: list[dict[str, float]] = []
    for _ in range(args.repeats):
        for name, plane in (("scheduler", sched), ("fifo", fifo)):
            tracing = args.trace and name == "scheduler"
            if tracing:
                await rx.command(ReceiverCommand(command="trace_on"))
                timeline.enable()
            lat, act_ids, kv_id, seconds = await _data_plane_round(plane, address, kv, act, interval)
            if tracing:
                theirs = (await rx.command(ReceiverCommand(command="trace_off"))).steps
                traced += breakdown(timeline.disable(), theirs, act_ids, {kv_id})
            rows[name] += lat
            kv_s[name].append(seconds)
        lat, seconds = await _raw_round(raw, raw_bulk, raw_act, kv, act, interval)
        rows["raw ucxx"] += lat
        kv_s["raw ucxx"].append(seconds)
    chunk = link.schedule.chunk_limit(TrafficClass.KV)
    bw = link.schedule.bandwidth.value
    chunk_ms = chunk / bw * 1000
    cfg = link.schedule.cfg
    print(f"\n(a) activation latency during a {args.size_mib} MiB KV transfer ({args.activation_kib} KiB activations "
          f"every {args.interval_ms} ms, {args.repeats} rounds; {load()})")
    print(f"    link: bandwidth {bw / 2**30:.2f} GiB/s, fixed cost {link.schedule.bandwidth.overhead * 1000:.2f} ms/chunk, "
          f"chunk {chunk / MiB:.2f} MiB = {chunk_ms:.2f} ms at that bandwidth, {cfg.max_in_flight} in flight, "
          f"express lane {'on' if link.schedule.express else 'off'}")
    if link.schedule.express:
        print(f"    bulk in flight: <= {cfg.bulk_in_flight_under_activation} while an activation is out, "
              f"<= {cfg.latency_in_flight} within {cfg.latency_window_s * 1000:.0f} ms of one")
    print(f"    {'mode':<18} {'n':>5} {'P50 ms':>9} {'P99 ms':>9} {'max ms':>9} {'KV GiB/s':>9}")
    gib = args.size_mib / 1024
    for name, lat in {**rows, **idle}.items():
        ms = [x * 1000 for x in lat]
        rate = f"{gib / (sum(kv_s[name]) / len(kv_s[name])):>9.2f}" if name in kv_s else f"{'-':>9}"
        print(f"    {name:<18} {len(ms):>5} {pct(ms, 0.5):>9.2f} {pct(ms, 0.99):>9.2f} {max(ms):>9.2f} {rate}")
    p99 = {name: pct(lat, 0.99) * 1000 for name, lat in rows.items()}
    goal = chunk_ms + 1.0
    print(f"    goal P99 <= chunk time + 1 ms = {goal:.2f} ms: {'met' if p99['scheduler'] <= goal else 'NOT met'} "
          f"({p99['scheduler']:.2f} ms); FIFO/scheduler P99 = {p99['fifo'] / p99['scheduler']:.1f}x (goal >= 10x); "
          f"raw ucxx on a second endpoint, no scheduling: P99 {p99['raw ucxx']:.2f} ms")
    if args.trace:
        print("    where the scheduler's activation latency goes (--trace; steps in tidal/bench/transfer_timeline.py):")
        print(report(traced))
    await raw.close()
    await sched.close()
    await fifo.close()
