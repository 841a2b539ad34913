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
from tidal.bench.transfer_latency import bench_activation_latency
from tidal.bench.transfer_proc import ReceiverProcess
from tidal.bench.transfer_throughput import bench_throughput

MiB = 1 << 20


def _chunking(args: argparse.Namespace) -> ChunkingConfig:
    lanes = dict(max_in_flight=args.in_flight, express_activations=not args.one_lane,
                 bulk_in_flight_under_activation=args.bulk_under_activation,
                 latency_in_flight=args.latency_in_flight or args.in_flight)
    if args.chunk_kib:  # pinned chunk size (for exploring the trade-off)
        return ChunkingConfig(min_chunk=args.chunk_kib << 10, max_chunk=args.chunk_kib << 10, **lanes)
    return ChunkingConfig(target_delay_s=args.target_delay_ms / 1000, **lanes)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


async def run(args: argparse.Namespace) -> int:
    rx = ReceiverProcess(cache_bytes=args.blocks_total * args.block_kib << 10 if not args.skip_blocks else 0)
    try:
        print(f"tidal bench transfer: UCX_TLS={os.environ.get('UCX_TLS', 'tcp,self,sm')}, {_load()}")
        if "a" in args.only:
            await bench_activation_latency(args, rx, _chunking(args), _load)
        if "b" in args.only:
            await bench_throughput(args, rx, _chunking(args), _load)
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
    parser.add_argument("--in-flight", type=int, default=ChunkingConfig.max_in_flight,
                        help="bulk chunks posted and not yet completed, per link")
    parser.add_argument("--chunk-kib", type=int, default=0, help="pin the bulk chunk size (0: from bandwidth)")
    parser.add_argument("--one-lane", action="store_true", help="activations share the bulk endpoint (no express lane)")
    parser.add_argument("--bulk-under-activation", type=int, default=ChunkingConfig.bulk_in_flight_under_activation,
                        help="bulk chunks allowed in flight while an activation is outstanding")
    parser.add_argument("--latency-in-flight", type=int, default=ChunkingConfig.latency_in_flight,
                        help="bulk chunks in flight within 100 ms of an activation (0: as --in-flight)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blocks-total", type=int, default=4096, help="(d) blocks in each side's cache")
    parser.add_argument("--blocks-moved", type=int, default=2048, help="(d) scattered blocks moved per round")
    parser.add_argument("--block-kib", type=int, default=64, help="(d) bytes per KV block")
    parser.add_argument("--skip-blocks", action="store_true", help="skip (d)")
    parser.add_argument("--only", default="abd", help="which parts to run, e.g. 'ab'")
    parser.add_argument("--trace", action="store_true", help="(a) split the scheduler's activation latency into steps")
    parser.set_defaults(func=run_bench)
