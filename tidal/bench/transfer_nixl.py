"""(d) of `tidal bench transfer`: KV blocks moved by the data plane (ucxx) vs by nixl.

A paged KV cache of `--blocks-total` blocks on each side; each round moves `--blocks-moved`
blocks with scattered ids to the same ids on the receiver, and the receiver checks every
byte. The data plane sends the block list as one transfer (chunks gather contiguous runs of
blocks on the sender and scatter them on the receiver); nixl posts one-sided UCX writes from
a descriptor list (no copies, no receiver CPU). Both run over the same UCX transports.
"""
from __future__ import annotations

import argparse
import base64
import os
import statistics
import time

from services.gpu_worker.transfer import DataPlane, DataPlaneConfig, TrafficClass
from tidal.bench.transfer_proc import ReceiverProcess
from tidal.bench.transfer_receiver import BlockSet, ReceiverCommand, nixl_side


async def _ucxx_round(link: object, rx: ReceiverProcess, blocks: BlockSet, src: object, key: str) -> float:
    assert (await rx.command(ReceiverCommand(command="expect_blocks", blocks=blocks, key=key))).ok
    views = [src[i] for i in blocks.ids()]  # type: ignore[index]
    t0 = time.perf_counter()
    await link.send(views, kind=TrafficClass.KV, key=key, timeout=600)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t0
    if not (await rx.command(ReceiverCommand(command="check_blocks", blocks=blocks))).ok:
        raise RuntimeError("data plane: the receiver's blocks do not match")
    return dt


async def _nixl_round(agent: object, remote: str, rx: ReceiverProcess, blocks: BlockSet, src_addr: int,
                      dst_addr: int) -> float:
    import asyncio

    bb = blocks.block_bytes
    ids = blocks.ids()
    local = agent.get_xfer_descs([(src_addr + int(i) * bb, bb, 0) for i in ids], "DRAM")  # type: ignore[attr-defined]
    far = agent.get_xfer_descs([(dst_addr + int(i) * bb, bb, 0) for i in ids], "DRAM")  # type: ignore[attr-defined]
    handle = agent.initialize_xfer("WRITE", local, far, remote)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    state = agent.transfer(handle)  # type: ignore[attr-defined]
    while state == "PROC":
        await asyncio.sleep(0)
        state = agent.check_xfer_state(handle)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t0
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"nixl transfer ended in state {state}")
    if not (await rx.command(ReceiverCommand(command="check_blocks", blocks=blocks))).ok:
        raise RuntimeError("nixl: the receiver's blocks do not match")
    return dt


async def kv_blocks_bench(args: argparse.Namespace, rx: ReceiverProcess) -> None:
    moved = args.blocks_moved * args.block_kib << 10
    print(f"\n(d) KV blocks: {args.blocks_moved} of {args.blocks_total} blocks x {args.block_kib} KiB "
          f"({moved / 2**20:.0f} MiB, scattered ids), median of {args.repeats} rounds "
          f"(load average {os.getloadavg()[0]:.2f})")
    rounds = [BlockSet(n_total=args.blocks_total, n_blocks=args.blocks_moved, block_bytes=args.block_kib << 10,
                       seed=100 + r) for r in range(args.repeats + 1)]
    plane = DataPlane("bench-blocks", config=DataPlaneConfig())
    link = await plane.link("bench-receiver", rx.ready.address)
    src = rounds[0].pattern().reshape(args.blocks_total, -1)
    agent, why = nixl_side("sender", src.reshape(-1)) if not rx.ready.nixl else (None, rx.ready.nixl)
    remote = agent.agent.add_remote_agent(base64.b64decode(rx.ready.nixl_metadata_b64)) if agent else ""
    ucxx_s, nixl_s = [], []
    for i, blocks in enumerate(rounds):
        src[:] = blocks.pattern().reshape(args.blocks_total, -1)
        u = await _ucxx_round(link, rx, blocks, src, f"blocks-{i}")
        n = await _nixl_round(agent.agent, remote, rx, blocks, agent.addr, rx.ready.nixl_cache_addr) if agent else 0.0
        if i:  # round 0 warms both paths up
            ucxx_s.append(u)
            nixl_s.append(n)
    gib = moved / 2**30
    u_rate = gib / statistics.median(ucxx_s)
    print(f"    data plane (ucxx):  {u_rate:6.2f} GiB/s  ({statistics.median(ucxx_s) * 1000:.1f} ms per round)")
    if agent is None:
        print(f"    nixl: not run — {why}")
    else:
        n_rate = gib / statistics.median(nixl_s)
        print(f"    nixl (UCX WRITE):   {n_rate:6.2f} GiB/s  ({statistics.median(nixl_s) * 1000:.1f} ms per round)")
        print(f"    ucxx/nixl = {u_rate / n_rate:.2f} (every round's bytes verified on the receiver)")
    await plane.close()
