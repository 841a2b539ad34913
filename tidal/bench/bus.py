"""`tidal bench bus`: typed request/reply through Tidal's bus vs raw nats-py, in the same run.

A responder process (its own NATS connection, uvloop) serves two subjects: a Tidal actor that
decodes a typed request and answers a typed reply through `shared.bus`, and a raw nats-py
callback that echoes the bytes (the floor). The requester (this process, another connection)
measures, for a small and a ~1 KiB payload:

* sequential latency: one request at a time — median, p99, and messages/s (the layers take
  turns request by request, in a shuffled order, so machine noise lands on all alike);
* concurrent throughput: `--concurrency` requests in flight — messages/s, in alternating rounds;
* CPU per request of requester + responder (not nats-server), in the concurrent mode.

A third row, `raw+hdr`, is raw nats-py carrying the same `tidal-deadline` header the bus puts
on every request: the part of the overhead that is nats-py's header handling, not our code.
The last line is the ratio.
Goal (issue 2): median overhead of the bus ≤ 20% over raw nats-py, p99 < 1 ms on loopback.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import msgspec

TYPED_SUBJECT = "tidal.v1.bench.echo"
RAW_SUBJECT = "tidal.v1.bench.raw"


class EchoRequest(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    model: str
    token_ids: list[int]
    text: str = ""


class EchoReply(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    token_ids: list[int]
    text: str = ""


def payloads() -> dict[str, EchoRequest]:
    small = EchoRequest(seq=1, model="llama-demo", token_ids=[1, 2, 3, 4, 5, 6, 7, 8])
    big = EchoRequest(seq=1, model="llama-demo", token_ids=list(range(100, 164)), text="x" * 800)
    return {"small": small, "1KiB": big}


# --- responder process -----------------------------------------------------------------
async def _responder(url: str) -> None:
    from shared.actors import Actor
    from shared.bus import Bus, BusSettings, Delivery

    class Echo(Actor):
        async def on_start(self) -> None:
            await self.bind(TYPED_SUBJECT, EchoRequest, self.echo)

        async def echo(self, msg: EchoRequest, _ctx: Delivery) -> EchoReply:
            return EchoReply(seq=msg.seq, token_ids=msg.token_ids, text=msg.text)

    bus = await Bus.connect(BusSettings(url=url), service="bench-responder")
    await Echo("echo").start(bus)
    nc = bus.nc

    async def raw_echo(msg) -> None:  # the floor: nats-py with no typing, headers or metrics
        await nc.publish(msg.reply, msg.data)

    await nc.subscribe(RAW_SUBJECT, cb=raw_echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


# --- requester -------------------------------------------------------------------------
def _process_cpu_s(pid: int) -> float:
    """CPU seconds used so far by another process's main thread (Linux schedstat, ns resolution; 0.0 elsewhere)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _sequential(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    samples = []
    perf = time.perf_counter
    for _ in range(n):
        start = perf()
        await call()
        samples.append(perf() - start)
    return samples


async def _concurrent(call: Callable[[], Awaitable[object]], n: int, concurrency: int) -> float:
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def _run(args: argparse.Namespace, url: str, responder_pid: int) -> list[str]:
    from shared.bus import Bus, BusSettings
    from shared.wire import HDR_DEADLINE

    bus = await Bus.connect(BusSettings(url=url), service="bench-requester")
    lines = [
        f"{'payload':8} {'layer':8} {'median µs':>10} {'p99 µs':>9} {'seq msg/s':>10} {'conc msg/s':>11} {'cpu µs/req':>11}"
    ]
    ratios: dict[str, tuple[float, float]] = {}
    try:
        for name, request in payloads().items():
            data = msgspec.msgpack.encode(request)

            async def tidal(request: EchoRequest = request) -> object:
                return await bus.request(TYPED_SUBJECT, request, EchoReply, timeout=5.0)

            async def raw(data: bytes = data) -> object:
                return await bus.nc.request(RAW_SUBJECT, data, timeout=5.0)

            async def raw_with_deadline(data: bytes = data) -> object:  # what the mandatory deadline header alone costs
                deadline = str(int((time.time() + 5.0) * 1000))
                return await bus.nc.request(RAW_SUBJECT, data, timeout=5.0, headers={HDR_DEADLINE: deadline})

            layers = {"tidal": tidal, "raw": raw, "raw+hdr": raw_with_deadline}
            lat: dict[str, list[float]] = {layer: [] for layer in layers}
            rate: dict[str, list[float]] = {layer: [] for layer in layers}
            cpu: dict[str, float] = {layer: 0.0 for layer in layers}
            for call in layers.values():
                await _sequential(call, args.warmup)
            # Sequential latency: the layers take turns request by request, so a burst of
            # machine noise lands on all of them alike.
            perf = time.perf_counter
            order = list(layers.items())
            for _ in range(args.requests):
                random.shuffle(order)
                for layer, call in order:
                    start = perf()
                    await call()
                    lat[layer].append(perf() - start)
            # Concurrent throughput (and CPU per request) in alternating rounds.
            per_round = max(1, args.requests // args.rounds)
            for _ in range(args.rounds):
                for layer, call in layers.items():
                    before = time.process_time() + _process_cpu_s(responder_pid)
                    rate[layer].append(await _concurrent(call, per_round, args.concurrency))
                    cpu[layer] += time.process_time() + _process_cpu_s(responder_pid) - before
            for layer in layers:
                samples = lat[layer]
                lines.append(
                    f"{name:8} {layer:8} {statistics.median(samples) * 1e6:10.1f} {_percentile(samples, 0.99) * 1e6:9.1f} "
                    f"{len(samples) / sum(samples):10.0f} {statistics.median(rate[layer]):11.0f} "
                    f"{cpu[layer] / (per_round * args.rounds) * 1e6:11.1f}"
                )
            ratios[name] = (
                statistics.median(lat["tidal"]) / statistics.median(lat["raw"]),
                statistics.median(rate["tidal"]) / statistics.median(rate["raw"]),
            )
    finally:
        await bus.close()
    lines.append(
        "ratio tidal/raw: median latency "
        + ", ".join(f"{r[0]:.2f}x ({n})" for n, r in ratios.items())
        + "; concurrent throughput "
        + ", ".join(f"{r[1]:.2f}x ({n})" for n, r in ratios.items())
    )
    return lines


def _start_responder(url: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.bench.bus", "--responder", "--nats", url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TIDAL_LOG_LEVEL": "warning"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"bench responder failed to start (said {line!r})")
    return proc


def run_bench(args: argparse.Namespace) -> int:
    import uvloop

    from shared.logging import configure_logging
    from shared.nats_server import NatsServer

    configure_logging("bench", level="warning")
    with tempfile.TemporaryDirectory(prefix="tidal-bench-bus-") as tmp:
        server = None if args.nats else NatsServer(store_dir=Path(tmp) / "nats", jetstream=False).start()
        url = args.nats or server.url
        responder = _start_responder(url)
        try:
            print(f"# tidal bench bus: {args.requests} sequential + {args.requests} concurrent (x{args.concurrency}) "
                  f"requests per layer and payload, {args.rounds} alternating rounds, nats {url}")
            print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other work on the machine adds noise)")
            for line in uvloop.run(_run(args, url, responder.pid)):
                print(line, flush=True)
        finally:
            assert responder.stdin is not None
            responder.stdin.close()
            try:
                responder.wait(5)
            except subprocess.TimeoutExpired:
                responder.kill()
            if server is not None:
                server.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bus", help="typed request/reply through the bus vs raw nats-py")
    _add_options(parser)
    parser.set_defaults(func=run_bench)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10000, help="requests per layer, payload and mode")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds of the concurrent mode")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in the throughput mode")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--nats", default=None, help="use this NATS instead of an embedded one")


def main() -> None:  # the responder side: `python -m tidal.bench.bus --responder --nats URL`
    parser = argparse.ArgumentParser()
    parser.add_argument("--responder", action="store_true")
    _add_options(parser)
    args = parser.parse_args()
    if args.responder:
        import uvloop

        from shared.logging import configure_logging

        configure_logging("bench-responder", level=os.environ.get("TIDAL_LOG_LEVEL", "warning"))
        uvloop.run(_responder(args.nats))
    else:
        sys.exit(run_bench(args))


if __name__ == "__main__":
    main()
