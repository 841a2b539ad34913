"""`tidal bench planner`: MELL's planning time per operation and per batch (issue 11).

A seeded, realistic operation stream -- Poisson arrivals, KV sizes from a long-tailed
(log-normal) distribution, each request growing in three updates from its prompt's KV to its
final KV, then departing -- sized so that the fleet runs about 70% full at steady state, is
fed to `shared.policy.mell.MellScheduler` on 64 and 512 devices: once op by op (the figure),
once in planning intervals through `run_batch` (per batch). The baseline, in the same run on
the same stream, is a trivial first-fit placement that never migrates (a request that
outgrows its device is re-placed by first fit). Goal: < 1 ms per operation at 64 devices.
The last line is the summary `bench planner: ms_per_op_64=... ms_per_op_512=...
baseline_ms_per_op_64=...`; figures and the printed report go to `--out`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

CAPACITY = 100_000  # KV units per device


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("planner", help="MELL planning time per op / per batch at 64 and 512 devices (goal < 1 ms/op)")
    p.add_argument("--devices", type=int, nargs="+", default=[64, 512], help="fleet sizes (64 must be one)")
    p.add_argument("--requests-per-device", type=int, default=100, help="requests in the stream per device")
    p.add_argument("--interval", type=float, default=1.0, help="seconds of stream per planning batch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="output directory (default runs/bench-planner-<time>)")
    p.set_defaults(func=run)


def make_stream(devices: int, requests: int, seed: int, load: float = 0.7) -> list[tuple[float, str, str, int]]:
    """(time, kind, request_id, size) sorted by time; kind is alloc, grow or depart."""
    rng = random.Random(seed)
    mu, sigma = math.log(CAPACITY / 12), 1.0  # median C/12, a long tail up to C
    finals = [min(CAPACITY, max(CAPACITY // 2000, int(rng.lognormvariate(mu, sigma)))) for _ in range(requests)]
    mean_life = 20.0
    mean_kv = sum(finals) / len(finals) * 0.7  # the average request is 70% grown
    rate = load * devices * CAPACITY / (mean_life * mean_kv)
    events: list[tuple[float, str, str, int]] = []
    t = 0.0
    for n, final in enumerate(finals):
        t += rng.expovariate(rate)
        rid = f"r{n}"
        life = rng.expovariate(1 / mean_life)
        size = max(1, int(final * rng.uniform(0.2, 0.6)))
        events.append((t, "alloc", rid, size))
        for k in (1, 2, 3):
            grown = max(size, int(size + (final - size) * k / 3))
            events.append((t + life * k / 4, "grow", rid, grown))
        events.append((t + life, "depart", rid, 0))
    events.sort(key=lambda e: e[0])
    return events


class FirstFitNoMigration:
    """The baseline: first device with room, scanned in order; no migration."""

    def __init__(self, capacity: int, devices: int) -> None:
        self.capacity = capacity
        self.free = [capacity] * devices
        self.where: dict[str, tuple[int, int]] = {}
        self.replaced = 0

    def _first_fit(self, size: int) -> int | None:
        return next((i for i, f in enumerate(self.free) if f >= size), None)

    def allocate(self, rid: str, size: int) -> bool:
        i = self._first_fit(size)
        if i is None:
            return False
        self.free[i] -= size
        self.where[rid] = (i, size)
        return True

    def update(self, rid: str, size: int) -> bool:
        i, old = self.where[rid]
        if self.free[i] >= size - old:
            self.free[i] -= size - old
            self.where[rid] = (i, size)
            return True
        self.free[i] += old
        j = self._first_fit(size)
        if j is None:
            self.free[i] -= old
            return False
        self.free[j] -= size
        self.where[rid] = (j, size)
        self.replaced += 1
        return True

    def depart(self, rid: str) -> None:
        i, old = self.where.pop(rid)
        self.free[i] += old

    def active(self) -> int:
        return sum(1 for f in self.free if f < self.capacity)


def _to_ops(events, known: set[str]):
    from shared.policy.mell import Allocate, Depart, Update

    for _, kind, rid, size in events:
        if kind == "alloc":
            yield Allocate(rid, size)
        elif rid in known:
            yield Update(rid, size) if kind == "grow" else Depart(rid)


def run_mell_per_op(events, devices: int) -> dict:
    from shared.policy.mell import Allocate, Depart, MellScheduler, NoCapacity

    s = MellScheduler(CAPACITY, [f"w{i}" for i in range(devices)])
    placed: set[str] = set()
    ops = moves = refused = peak = 0
    elapsed = 0.0
    for op in _to_ops(events, placed):
        t0 = time.perf_counter()
        try:
            r = s.apply(op)
        except NoCapacity:
            elapsed += time.perf_counter() - t0
            refused += 1
            continue
        elapsed += time.perf_counter() - t0
        ops += 1
        moves += len(r.moves)
        if isinstance(op, Allocate):
            placed.add(op.request_id)
        elif isinstance(op, Depart):
            placed.discard(op.request_id)
        peak = max(peak, len(s.fleet.active))
    return {"ops": ops, "ms_per_op": elapsed * 1e3 / max(ops, 1), "moves_per_op": moves / max(ops, 1),
            "refused": refused, "peak_devices": peak, "capped_ops": s.capped_operations}


def run_mell_batched(events, devices: int, interval: float) -> dict:
    from shared.policy.mell import Allocate, Depart, MellScheduler, NoCapacity

    s = MellScheduler(CAPACITY, [f"w{i}" for i in range(devices)])
    placed: set[str] = set()
    ops = moves = before = batches = refused = 0
    elapsed = 0.0
    i = 0
    while i < len(events):
        end = events[i][0] + interval
        j = i
        while j < len(events) and events[j][0] < end:
            j += 1
        batch = list(_to_ops(events[i:j], placed | {e[2] for e in events[i:j] if e[1] == "alloc"}))
        t0 = time.perf_counter()
        try:
            r = s.run_batch(batch)
        except NoCapacity:  # a batch whose allocation found no device: counted, its rest dropped
            refused += 1
            r = None
        elapsed += time.perf_counter() - t0
        placed = {rid for rid in placed | {op.request_id for op in batch if isinstance(op, Allocate)}
                  if s.device_of(rid) is not None}
        placed -= {op.request_id for op in batch if isinstance(op, Depart)}
        if r is not None:
            moves += len(r.moves)
            before += r.moves_before_dedup
        ops += len(batch)
        batches += 1
        i = j
    return {"ops": ops, "batches": batches, "ms_per_batch": elapsed * 1e3 / max(batches, 1),
            "ms_per_op": elapsed * 1e3 / max(ops, 1), "moves_per_op": moves / max(ops, 1),
            "moves_before_dedup_per_op": before / max(ops, 1), "refused_batches": refused}


def run_baseline(events, devices: int) -> dict:
    b = FirstFitNoMigration(CAPACITY, devices)
    ops = refused = peak = 0
    elapsed = 0.0
    for _, kind, rid, size in events:
        if kind != "alloc" and rid not in b.where:
            continue
        t0 = time.perf_counter()
        if kind == "alloc":
            ok = b.allocate(rid, size)
        elif kind == "grow":
            ok = b.update(rid, size)
        else:
            ok = True
            b.depart(rid)
        elapsed += time.perf_counter() - t0
        ops += 1
        refused += not ok
        peak = max(peak, b.active()) if kind == "alloc" else peak
    return {"ops": ops, "ms_per_op": elapsed * 1e3 / max(ops, 1), "refused": refused, "peak_devices": peak,
            "replaced": b.replaced}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or f"runs/bench-planner-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    out.mkdir(parents=True, exist_ok=True)
    if 64 not in args.devices:
        args.devices = [64, *args.devices]
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"planner bench: C={CAPACITY}, {args.requests_per_device} requests/device, interval {args.interval} s, "
        f"seed {args.seed}; load average {os.getloadavg()[0]:.2f}")
    results: dict[str, dict] = {}
    for d in args.devices:
        events = make_stream(d, args.requests_per_device * d, args.seed)
        mell = run_mell_per_op(events, d)
        batched = run_mell_batched(events, d, args.interval)
        base = run_baseline(events, d)
        results[str(d)] = {"mell": mell, "mell_batched": batched, "baseline_first_fit": base}
        say(f"  {d:>4} devices, {mell['ops']:>7} ops: MELL {mell['ms_per_op'] * 1e3:.1f} us/op "
            f"({mell['moves_per_op']:.3f} moves/op, peak {mell['peak_devices']} devices, {mell['refused']} refused, "
            f"{mell['capped_ops']} capped ops)")
        say(f"  {d:>4} devices, {batched['batches']:>7} batches: MELL batched {batched['ms_per_batch']:.3f} ms/batch, "
            f"{batched['ms_per_op'] * 1e3:.1f} us/op ({batched['moves_per_op']:.3f} moves/op after dedup, "
            f"{batched['moves_before_dedup_per_op']:.3f} before)")
        say(f"  {d:>4} devices, baseline first-fit no migration {base['ms_per_op'] * 1e3:.1f} us/op "
            f"(peak {base['peak_devices']} devices, {base['refused']} refused, {base['replaced']} re-placed)")
    m64 = results["64"]["mell"]["ms_per_op"]
    say(f"goal < 1 ms/op at 64 devices: {m64:.3f} ({'met' if m64 < 1 else 'MISSED'})")
    m512 = results[str(max(args.devices))]["mell"]["ms_per_op"]
    summary = (f"bench planner: ms_per_op_64={m64:.3f} ms_per_op_512={m512:.3f} "
               f"baseline_ms_per_op_64={results['64']['baseline_first_fit']['ms_per_op']:.3f}")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    (out / "report.txt").write_text("\n".join([*lines, summary]) + "\n")
    print(summary)
    return 0
