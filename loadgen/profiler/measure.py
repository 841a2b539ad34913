"""Time the real engine's steps for the simulator's cost model (`tidal profile`).

`LLMEngine.step()` is timed whole — scheduling, the forward pass, sampling, detokenizing —
because that is what one simulated step stands for. Two families of steps:

- decode: B sequences with C tokens of context each, every one decoding (no prefill in the
  step); the median of several steps per (B, C);
- prefill: one fresh request of P prompt tokens prefilled in one step (P within the step
  budget); the median over a few requests per P.

Each sample is the step's features in the simulator's terms (`StepCost.step_s` arguments)
and its measured seconds: wall-clock seconds, or with `clock="cpu"` the process's CPU seconds —
the engine's own cost without the time other processes took the core (a shared host), which the
live path's calibration (calibrate.py) then adds back as measured at the time of a live run. Transfers: a memory copy and a loopback TCP stream are timed for
the `shm` and `tcp` links.
"""
from __future__ import annotations

import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepSample:
    decode_seqs: int
    decode_ctx: int  # context tokens of the decoding sequences, summed
    prefill_tokens: int
    prefill_attn: int  # sum over prefill chunks of chunk tokens x context after the chunk
    seconds: float


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(min(16, vocab - 1), vocab) for _ in range(n)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure_decode(engine, batches: list[int], contexts: list[int], steps: int, vocab: int,  # type: ignore[no-untyped-def]
                   seed: int = 0, clock: str = "wall") -> list[StepSample]:
    now = CLOCKS[clock]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    samples = []
    for c in contexts:
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        for b in batches:
            if c + steps + 4 > engine.max_model_len:
                continue
            ids = [f"dec-{b}-{c}-{i}" for i in range(b)]
            for rid in ids:
                engine.add_request(rid, _ids(rng, c, vocab), params)
            while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + engine.scheduler.waiting):
                engine.step()  # prefill until every sequence decodes
            times, ctx = [], []
            for k in range(steps):
                running = engine.scheduler.running
                if len(running) != b:
                    break
                ctx_sum = sum(s.num_tokens for s in running)
                start = now()
                engine.step()
                times.append(now() - start)
                ctx.append(ctx_sum)
            for rid in ids:
                engine.abort(rid)
            engine.step()
            if times:
                med = statistics.median(times)
                samples.append(StepSample(b, int(statistics.median(ctx)), 0, 0, med))
    return samples


def measure_prefill(engine, lengths: list[int], repeats: int, vocab: int, seed: int = 1,  # type: ignore[no-untyped-def]
                    clock: str = "wall") -> list[StepSample]:
    now = CLOCKS[clock]
    from services.gpu_worker.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    samples = []
    for p in lengths:
        times = []
        for r in range(repeats):
            engine.add_request(f"pre-{p}-{r}", _ids(rng, p, vocab), params)
            start = now()
            engine.step()  # the whole prompt in one chunk (p <= the step budget)
            times.append(now() - start)
            while engine.has_unfinished:
                engine.step()
        samples.append(StepSample(0, 0, p, p * p, statistics.median(times)))
    return samples


def measure_copy(nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float, float]:
    """(latency_s, bytes/s) of an in-memory tensor copy (the shared-memory link)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    small = [_timed(lambda: dst[:64].copy_(src[:64])) for _ in range(repeats)]
    big = [_timed(lambda: dst.copy_(src)) for _ in range(repeats)]
    return min(small), nbytes / min(big)


def measure_tcp(nbytes: int = 32 << 20) -> tuple[float, float]:
    """(round-trip latency_s / 2, bytes/s) of one loopback TCP stream (the tcp link)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                data = conn.recv(1 << 20)
                if not data or data == b"p":
                    if data == b"p":
                        conn.sendall(b"p")
                        continue
                    return

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pings = []
        for _ in range(20):
            start = time.perf_counter()
            client.sendall(b"p")
            client.recv(1)
            pings.append(time.perf_counter() - start)
        payload = b"\0" * nbytes
        start = time.perf_counter()
        client.sendall(payload)
        client.shutdown(socket.SHUT_WR)
        thread.join(30)
        seconds = time.perf_counter() - start
    server.close()
    return min(pings) / 2, nbytes / seconds


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


__all__ = ["StepSample", "measure_copy", "measure_decode", "measure_prefill", "measure_tcp"]
