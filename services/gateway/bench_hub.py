"""`python -m services.gateway.bench_hub`: what receiving token chunks costs the gateway, per mode.

Compares the two ways the hub receives a request's chunks — one wildcard subscription with a
dict of routes, or one subscription per request — on the gateway's real path (StreamHub +
Generation: subscribe, submit, receive in order, close), without HTTP and without an engine:
a separate process answers each submit and publishes `--chunks` chunks for it as fast as it
can. Reported per mode: chunks/s and the gateway process's CPU microseconds per chunk and per
request (the publisher's CPU is not counted). Prints figures, asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PUBLISHER = r"""
import asyncio, sys
from shared.bus import Bus, BusSettings
from shared.events.common import Usage
from shared.events.dispatch import SubmitAccepted, SubmitRequest
from shared.events.stream import TokenChunk
from shared.subjects import dispatch_submit, request_out

async def main(url, chunks):
    bus = await Bus.connect(BusSettings(url=url), service="dispatcher")

    async def stream(req):
        out = request_out(req.request_id)
        for seq in range(chunks):
            final = seq == chunks - 1
            await bus.publish(out, TokenChunk(
                request_id=req.request_id, seq=seq, token_ids=[seq % 500 + 3], text="tok ",
                finish_reason="length" if final else None,
                usage=Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=chunks) if final else None))
            if seq % 8 == 7:
                await asyncio.sleep(0)  # interleave requests, as engine steps do

    async def on_submit(req, _ctx):
        asyncio.ensure_future(stream(req))
        return SubmitAccepted(request_id=req.request_id, worker_id="w0", instance_id="i0")

    await bus.subscribe(dispatch_submit(), SubmitRequest, on_submit, queue="dispatcher")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def run_mode(url: str, mode: str, requests: int, concurrency: int) -> tuple[float, float, int]:
    from services.gateway.generation import Generation
    from services.gateway.hub import StreamHub
    from shared.bus import Bus, BusSettings
    from shared.events.common import SamplingParams
    from shared.events.dispatch import SubmitRequest

    bus = await Bus.connect(BusSettings(url=url), service="gateway")
    hub = StreamHub(bus, mode=mode)  # type: ignore[arg-type]
    await hub.start()
    received = 0
    next_id = 0

    async def client() -> None:
        nonlocal received, next_id
        while next_id < requests:
            next_id += 1
            submit = SubmitRequest(request_id=f"bench-{mode}-{next_id}", model="m", prompt_token_ids=[1, 2, 3],
                                   sampling=SamplingParams(max_tokens=16), arrival_ts=time.time())
            gen = Generation(hub, [submit], prompt_groups=[0], timeout_s=60)
            await gen.start()
            async for batch in gen.batches():
                received += len(batch)
            await gen.close()

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await hub.stop()
    await bus.close()
    return wall, cpu, received


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.gateway.bench_hub", description=__doc__)
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=64, help="chunks per request")
    parser.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating (best is kept)")
    args = parser.parse_args(argv)

    from shared.nats_server import NatsServer

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        nats = NatsServer(store_dir=Path(tmp) / "nats").start()
        publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, nats.url, str(args.chunks)], cwd=root,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert publisher.stdout is not None
            while publisher.stdout.readline().strip() != "ready":  # after its log lines
                assert publisher.poll() is None, "the publisher exited"
            best: dict[str, tuple[float, float, int]] = {}
            for _ in range(args.rounds):
                for mode in ("wildcard", "per_request"):
                    result = asyncio.run(run_mode(nats.url, mode, args.requests, args.concurrency))
                    if mode not in best or result[1] < best[mode][1]:
                        best[mode] = result
        finally:
            publisher.terminate()
            publisher.wait()
            nats.stop()
    print(f"{args.requests} requests x {args.chunks} chunks, {args.concurrency} concurrent")
    print(f"{'mode':<12} {'chunks/s':>10} {'cpu us/chunk':>13} {'cpu us/request':>15}")
    for mode, (wall, cpu, chunks) in best.items():
        print(f"{mode:<12} {chunks / wall:>10.0f} {cpu / chunks * 1e6:>13.1f} {cpu / args.requests * 1e6:>15.0f}")
    ratio = best["per_request"][1] / best["wildcard"][1]
    print(f"per_request / wildcard gateway CPU: {ratio:.2f}")


if __name__ == "__main__":
    main()
