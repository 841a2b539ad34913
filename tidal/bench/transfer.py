"""`tidal bench transfer`: the data plane on loopback, each figure beside its baseline from the same run.

A receiver process (`tidal.bench.transfer_receiver`, its own UCX worker) and this process:

(a) activation latency (submit -> acknowledged) P50/P99 while a 1 GiB KV transfer runs on
    the same link, through the transfer scheduler vs a plain FIFO link (whole transfers in
    arrival order). Goal (issue 6): P99 <= one chunk time + 1 ms and >= 10x better than FIFO.
(b) bulk throughput of a chunked transfer (checksums, headers, acks) vs ONE raw ucxx send
    of the same bytes into the same preallocated buffer. Goal: >= 90%.
(d) KV blocks (scattered block ids of a paged cache) moved by the data plane (ucxx) vs by
    nixl (one-sided UCX writes from a descriptor list), when nixl imports here.

The machine is shared: the load average is printed beside the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np

from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass
from tidal.bench.transfer_nixl import kv_blocks_bench
from services.gpu_worker.transfer import timeline
from tidal.bench.transfer_proc import ReceiverProcess
from tidal.bench.transfer_receiver import ReceiverCommand
from tidal.bench.transfer_timeline import breakdown, report

MiB = 1 << 20


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _chunking(args: argparse.Namespace) -> ChunkingConfig:
    if args.chunk_kib:  # pinned chunk size (for exploring the trade-off)
        return ChunkingConfig(min_chunk=args.chunk_kib << 10, max_chunk=args.chunk_kib << 10,
                              max_in_flight=args.in_flight)
    return ChunkingConfig(target_delay_s=args.target_delay_ms / 1000, max_in_flight=args.in_flight)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


async def _activations_during_kv(plane: DataPlane, address: str, kv: np.ndarray, act: np.ndarray,
                                 interval_s: float) -> tuple[list[float], set[int], int]:
    """Latencies of activations submitted every `interval_s` while `kv` is in flight; their
    transfer ids and the KV transfer's."""
    link = await plane.link("bench-receiver", address)
    bulk = await link.submit(kv, kind=TrafficClass.KV, key="kv")
    handles = []
    while not bulk.done():
        handles.append(await link.submit(act, kind=TrafficClass.ACTIVATION, key="act"))
        await asyncio.sleep(interval_s)
    await bulk.wait(600)
    latencies = [(await h.wait(600)).seconds for h in handles]
    return latencies, {h.transfer_id for h in handles}, bulk.transfer_id


async def bench_activation_latency(args: argparse.Namespace, rx: ReceiverProcess) -> None:
    kv = np.ones(args.size_mib * MiB, dtype=np.uint8)
    act = np.ones(args.activation_kib << 10, dtype=np.uint8)
    sched = DataPlane("bench-sched", config=DataPlaneConfig(chunking=_chunking(args)))
    fifo = DataPlane("bench-fifo", config=DataPlaneConfig(chunking=ChunkingConfig(fifo=True)))
    link = await sched.link("bench-receiver", rx.ready.address)
    await link.send(kv[: 64 * MiB], kind=TrafficClass.KV, key="warmup")  # measure the link first
    await (await fifo.link("bench-receiver", rx.ready.address)).send(kv[: 64 * MiB], kind=TrafficClass.KV, key="w")
    rows: dict[str, list[float]] = {"scheduler": [], "fifo": []}
    traced: list[dict[str, float]] = []
    for _ in range(args.repeats):
        for name, plane in (("scheduler", sched), ("fifo", fifo)):
            tracing = args.trace and name == "scheduler"
            if tracing:
                await rx.command(ReceiverCommand(command="trace_on"))
                timeline.enable()
            lat, act_ids, kv_id = await _activations_during_kv(plane, rx.ready.address, kv, act, args.interval_ms / 1000)
            if tracing:
                theirs = (await rx.command(ReceiverCommand(command="trace_off"))).steps
                traced += breakdown(timeline.disable(), theirs, act_ids, {kv_id})
            rows[name] += lat
    chunk = link.schedule.chunk_limit(TrafficClass.KV)
    bw = link.schedule.bandwidth.value
    chunk_ms = chunk / bw * 1000
    print(f"\n(a) activation latency during a {args.size_mib} MiB KV transfer ({args.activation_kib} KiB activations "
          f"every {args.interval_ms} ms, {args.repeats} rounds; {_load()})")
    print(f"    link: bandwidth {bw / 2**30:.2f} GiB/s, fixed cost {link.schedule.bandwidth.overhead * 1000:.2f} ms/chunk, "
          f"chunk {chunk / MiB:.2f} MiB = {chunk_ms:.2f} ms, {link.schedule.cfg.max_in_flight} in flight")
    print(f"    {'mode':<10} {'n':>5} {'P50 ms':>9} {'P99 ms':>9} {'max ms':>9}")
    p99 = {}
    for name, lat in rows.items():
        ms = [x * 1000 for x in lat]
        p99[name] = _pct(ms, 0.99)
        print(f"    {name:<10} {len(ms):>5} {_pct(ms, 0.5):>9.2f} {p99[name]:>9.2f} {max(ms):>9.2f}")
    goal = chunk_ms + 1.0
    print(f"    goal P99 <= chunk time + 1 ms = {goal:.2f} ms: {'met' if p99['scheduler'] <= goal else 'NOT met'}; "
          f"FIFO/scheduler P99 = {p99['fifo'] / p99['scheduler']:.1f}x (goal >= 10x)")
    if args.trace:
        print("    where the scheduler's activation latency goes (--trace; steps in tidal/bench/transfer_timeline.py):")
        print(report(traced))
    await sched.close()
    await fifo.close()


async def bench_throughput(args: argparse.Namespace, rx: ReceiverProcess) -> None:
    buf = np.ones(args.size_mib * MiB, dtype=np.uint8)
    plane = DataPlane("bench-bulk", config=DataPlaneConfig(chunking=_chunking(args)))
    link = await plane.link("bench-receiver", rx.ready.address)
    ucxx = plane._runtime()
    raw = await ucxx.create_endpoint("127.0.0.1", rx.ready.raw_port)
    ctl, ack = np.array([buf.shape[0]], dtype=np.int64), np.empty(1, dtype=np.uint8)

    async def raw_once() -> float:
        t0 = time.perf_counter()
        await raw.send(ctl)
        await raw.send(buf)
        await raw.recv(ack)
        return time.perf_counter() - t0

    async def chunked_once() -> float:
        t0 = time.perf_counter()
        await link.send(buf, kind=TrafficClass.KV, key="bulk", timeout=600)
        return time.perf_counter() - t0

    await raw_once()
    await chunked_once()  # warm both paths; the link learns its bandwidth
    raw_s, chunked_s = [], []
    for _ in range(args.repeats):
        raw_s.append(await raw_once())
        chunked_s.append(await chunked_once())
    gib = buf.shape[0] / 2**30
    r, c = gib / statistics.median(raw_s), gib / statistics.median(chunked_s)
    print(f"\n(b) bulk throughput, {args.size_mib} MiB, median of {args.repeats} alternating rounds ({_load()})")
    print(f"    raw ucxx, one send:        {r:6.2f} GiB/s   (rounds: {', '.join(f'{gib / s:.2f}' for s in raw_s)})")
    print(f"    data plane, chunked:       {c:6.2f} GiB/s   (rounds: {', '.join(f'{gib / s:.2f}' for s in chunked_s)}; "
          f"chunk {link.schedule.chunk_limit(TrafficClass.KV) / MiB:.2f} MiB)")
    print(f"    chunked/raw = {c / r:.2f} (goal >= 0.90)")
    await raw.close()
    await plane.close()


async def run(args: argparse.Namespace) -> int:
    rx = ReceiverProcess(cache_bytes=args.blocks_total * args.block_kib << 10 if not args.skip_blocks else 0)
    try:
        print(f"tidal bench transfer: UCX_TLS={os.environ.get('UCX_TLS', 'tcp,self,sm')}, {_load()}")
        if "a" in args.only:
            await bench_activation_latency(args, rx)
        if "b" in args.only:
            await bench_throughput(args, rx)
        if "d" in args.only and not args.skip_blocks:
            await kv_blocks_bench(args, rx)
    finally:
        rx.stop()
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("transfer", help="data plane: activation latency under bulk, throughput, ucxx vs nixl")
    parser.add_argument("--size-mib", type=int, default=1024, help="bulk (KV) transfer size")
    parser.add_argument("--activation-kib", type=int, default=256)
    parser.add_argument("--interval-ms", type=float, default=5.0, help="between activations during the bulk")
    parser.add_argument("--target-delay-ms", type=float, default=2.0, help="preemption delay the chunk size targets")
    parser.add_argument("--in-flight", type=int, default=2, help="chunks posted and not yet completed, per link")
    parser.add_argument("--chunk-kib", type=int, default=0, help="pin the bulk chunk size (0: from bandwidth)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks-total", type=int, default=4096, help="(d) blocks in each side's cache")
    parser.add_argument("--blocks-moved", type=int, default=2048, help="(d) scattered blocks moved per round")
    parser.add_argument("--block-kib", type=int, default=64, help="(d) bytes per KV block")
    parser.add_argument("--skip-blocks", action="store_true", help="skip (d)")
    parser.add_argument("--only", default="abd", help="which parts to run, e.g. 'ab'")
    parser.add_argument("--trace", action="store_true", help="(a) split the scheduler's activation latency into steps")
    parser.set_defaults(func=run_bench)
