"""(b) of `tidal bench transfer`: bulk throughput of the data plane vs ONE raw ucxx send.

Rows, rounds alternating, medians:

* raw ucxx, one send          the baseline: one tag send of all the bytes into one receive
* raw ucxx, same chunks       the data plane's chunk size and in-flight depth, but plain
                              ucxx messages (no frames, checksums or acks): what UCX itself
                              charges per message
* data plane, no checksums    the data plane with `checksum="none"`
* data plane                  as deployed: frames, xxh3 per chunk on both sides, an Ack
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Awaitable, Callable

import numpy as np

from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass
from tidal.bench.transfer_latency import RawPeer
from tidal.bench.transfer_proc import ReceiverProcess

MiB = 1 << 20


async def bench_throughput(args: argparse.Namespace, rx: ReceiverProcess, chunking: ChunkingConfig,
                           load: Callable[[], str]) -> None:
    buf = np.ones(args.size_mib * MiB, dtype=np.uint8)
    plane = DataPlane("bench-bulk", config=DataPlaneConfig(chunking=chunking))
    bare = DataPlane("bench-bulk-nock", config=DataPlaneConfig(chunking=chunking, checksums=False))
    link = await plane.link("bench-receiver", rx.ready.address)
    bare_link = await bare.link("bench-receiver", rx.ready.address)
    raw = RawPeer(plane._runtime(), rx.ready.raw_port)
    ep = await raw.endpoint()

    async def timed(send: Callable[[], Awaitable[object]]) -> float:
        t0 = time.perf_counter()
        await send()
        return time.perf_counter() - t0

    await link.send(buf, kind=TrafficClass.KV, key="bulk", timeout=600)  # warm up; the link learns its bandwidth
    chunk = link.schedule.chunk_limit(TrafficClass.KV)
    rows: dict[str, Callable[[], Awaitable[object]]] = {
        "raw ucxx, one send": lambda: raw.round_trip(ep, buf),
        "raw ucxx, same chunks": lambda: raw.round_trip(ep, buf, chunk, chunking.max_in_flight),
        "data plane, no checksums": lambda: bare_link.send(buf, kind=TrafficClass.KV, key="bulk", timeout=600),
        "data plane": lambda: link.send(buf, kind=TrafficClass.KV, key="bulk", timeout=600),
    }
    for send in rows.values():
        await send()
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, send in rows.items():
            seconds[name].append(await timed(send))
    gib = buf.shape[0] / 2**30
    rate = {name: gib / statistics.median(s) for name, s in seconds.items()}
    raw_rate = rate["raw ucxx, one send"]
    print(f"\n(b) bulk throughput, {args.size_mib} MiB, median of {args.repeats} alternating rounds ({load()})")
    print(f"    chunk {chunk / MiB:.2f} MiB, {chunking.max_in_flight} in flight")
    for name, s in seconds.items():
        print(f"    {name:<26} {rate[name]:6.2f} GiB/s  {rate[name] / raw_rate:5.2f} of one send   "
              f"(rounds: {', '.join(f'{gib / x:.2f}' for x in s)})")
    print(f"    chunked/raw = {rate['data plane'] / raw_rate:.2f} (goal >= 0.90)")
    await raw.close()
    await plane.close()
    await bare.close()
