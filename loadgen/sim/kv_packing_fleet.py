"""The KV-packing fleet: what a placement policy's devices physically do, request by request, when
requests' timing depends on where they run (the baselines wait or are preempted; moves take time).

`run_policy` (kv_packing.py) replays one fixed op stream: fine while no device ever holds more than
it can. Here a policy's *books* (its placement: MellScheduler or a bin-packing baseline) drive
simulated devices, and the devices play out what an engine does (the "vllm-0.6" engine mode of
loadgen/sim/engine_modes.py, at planning-interval granularity):

- A request's KV at a boundary is its prompt plus the tokens decoded so far (one per `decode_step_s`
  after prefill), reported to the policy in granules as in kv_packing.build_schedule (Allocate at the
  first boundary after arrival, Update when it crosses a granule, Depart at the first boundary after
  its last token). With nothing delayed, the op stream is exactly the schedule's.
- Physically a device holds its running requests' KV in the engine's blocks (`block_size` tokens;
  the repro's granules are whole blocks, so the books never see less), plus the blocks a copy into it
  has reserved. Each boundary:
  a device whose blocks exceed C preempts its newest running request (recompute: its KV is freed,
  it waits at the head of that device's queue, vLLM's victim order) until they fit; then the queue
  is admitted first come first served while the head fits (an arrival the policy put on a device
  without room waits there too). A preempted request re-prefills prompt + generated tokens when
  admitted; every wait and re-prefill shifts the rest of the request (its TTFT or TPOT: reported).
- A move the policy books is physically a migration (kv_packing_moves.py's costs, shared by every
  policy): "kv" mode is Llumnix's pre-copy from the source's interface to the destination's
  (serialised per interface), the destination reserving the request's blocks for the whole copy and
  the source keeping them until the hand-over, then a stall (the last stage); it fails when the
  destination has no room, the pre-copy does not converge, the request ends first or is preempted on
  the source. "tokens" mode frees the source at once and re-prefills the context on the destination
  (the request stalls for that prefill). A failed move is put back in the books when the policy can
  (`relocate`: the baselines, whose books are the devices); MELL's books keep the request where MELL
  wants it and the move is retried the next interval. A request waiting for memory moves for free.
- `mode="auto"` is MELL §V's adaptive migration: every interval the moves not yet under way are packed
  (shared/policy/mell_migration.choose_migration_modes, the planner's code) into the communication
  boundary -- each device's network interface, bytes per interval each way, less what copies already
  queued on it still need -- and the computation boundary -- each destination's re-prefill tokens per
  interval (`Budgets`; a destination with no re-prefill under way takes one longer than an interval's
  budget, which then runs on); what fits neither waits for the next interval.
- Policies see what a copy still holds: before each batch, the bytes a device physically holds for
  requests the books have moved away are given to the policy (`MellScheduler.hold`,
  `BinPackPolicy.held`), so nothing is placed into memory a copy still occupies.
- A device counts as active while the books have it or it physically holds anything (a request,
  a waiting one, a reservation). `LoadBalance.balance` runs after each batch with the devices that
  have a migration in flight excluded (the concurrency limit).
"""
from __future__ import annotations

import math
import time
from bisect import insort
from dataclasses import dataclass

import numpy as np

from loadgen.sim.kv_packing import PackingResult, Schedule
from loadgen.sim.kv_packing_moves import MoveModel, MoveStats
from shared.policy.mell_migration import MigrationCandidate, choose_migration_modes
from shared.policy.mell_ops import Allocate, Depart, Update

FUTURE, RUNNING, QUEUED, DONE = 0, 1, 2, 3
INF = float("inf")


@dataclass(frozen=True)
class Budgets:
    """MELL §V's boundaries, per second of a planning interval (adaptive migration)."""

    link_bytes_per_s: float  # one device's network interface, each direction (communication boundary)
    prefill_tokens_per_s: float  # a destination's compute spare for re-prefill (computation boundary)

    def __post_init__(self) -> None:
        if self.link_bytes_per_s < 0 or self.prefill_tokens_per_s < 0:
            raise ValueError(f"budgets must be >= 0, got {self.link_bytes_per_s}, {self.prefill_tokens_per_s}")


@dataclass(frozen=True)
class FleetResult(PackingResult):
    used_bytes: np.ndarray | None = None  # per epoch: the granules of the running requests (for utilisation)
    requests: int = 0
    decided: int = 0  # moves the policy decided (after batching)
    removed_by_batching: int = 0  # moves the policy's batches dropped
    capped_ops: int = 0  # MELL operations that stopped at the migration cap
    kv_migrations: int = 0  # handed over
    token_migrations: int = 0
    deferred: int = 0  # move-intervals the boundaries deferred
    requeued: int = 0  # moves of requests waiting for memory (free)
    preemptions: int = 0
    held_back: int = 0  # arrivals that waited for memory on the device they were put on
    ttft_delay: np.ndarray | None = None  # per request: seconds added before its first token
    tpot_delay: np.ndarray | None = None  # per request: seconds added after it, per later token
    max_moves_per_round: int = 0  # LB: the most migrations one balancing round decided

    @property
    def migrations(self) -> int:
        """Migrations carried out (KV hand-overs and token moves)."""
        return self.kv_migrations + self.token_migrations


class _Device:
    __slots__ = ("running", "queue", "incoming", "out", "ub", "nic_out", "nic_in", "prefill_busy")

    def __init__(self) -> None:
        self.running: set[int] = set()
        self.queue: list[int] = []  # waiting for memory, by arrival order
        self.incoming: set[int] = set()  # copies reserving blocks here
        self.out: set[int] = set()  # copies leaving (still here until the hand-over)
        self.ub = 0  # running + incoming requests' granules in whole blocks: an upper bound of the blocks held
        self.nic_out = self.nic_in = 0.0  # when this device's interface is free again, each way
        self.prefill_busy = 0.0  # when its re-prefills queued so far are done

    def empty(self) -> bool:
        return not (self.running or self.queue or self.incoming)


@dataclass
class _Flight:
    request: int
    source: str
    destination: str
    done_s: float
    ok: bool
    stall_s: float
    reason: str = ""


def run_fleet(schedule: Schedule, policy, name: str, *, moves: MoveModel | None = None, mode: str = "kv",
              budgets: Budgets | None = None, per_op: bool = False, check: bool = True) -> FleetResult:
    """Play `schedule`'s requests on `policy`'s books and simulated devices (module docstring). `mode`: how
    the policy's moves travel ("kv", "tokens", or "auto" = adaptive under `budgets`); `per_op`: ops one by one
    (measures the most moves one operation decides)."""
    if schedule.prompt is None or schedule.first_token_s is None:
        raise ValueError(f"{name}: the fleet needs a schedule with its requests (kv_packing.build_schedule)")
    if mode not in ("kv", "tokens", "auto"):
        raise ValueError(f"mode must be kv, tokens or auto, got {mode!r}")
    if mode == "auto" and budgets is None:
        raise ValueError(f"{name}: adaptive migration needs budgets")
    return _Fleet(schedule, policy, name, moves, mode, budgets, per_op, check).run()


class _Fleet:
    def __init__(self, schedule: Schedule, policy, name: str, moves: MoveModel | None, mode: str,
                 budgets: Budgets | None, per_op: bool, check: bool) -> None:
        s = schedule
        self.s, self.policy, self.name, self.model, self.mode, self.budgets = s, policy, name, moves, mode, budgets
        self.per_op, self.check = per_op, check
        self.E = s.epoch_s
        self.C = s.capacity
        self.bpt = s.bytes_per_token
        self.G = s.granule_tokens
        self.cap_tok = s.capacity // s.bytes_per_token
        self.step = s.decode_step_s
        self.blk = moves.block_size if moves is not None else 1
        n = self.n = s.requests
        self.P = [int(x) for x in s.prompt]
        self.O = [int(x) for x in s.output]
        self.TF = [float(x) for x in s.first_token_s]
        self.ids = [f"r{i}" for i in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.size = [0] * n  # granule bytes the books know
        self.ubs = [0] * n  # the granule in whole blocks (what the device's upper bound counts)
        self.base = list(self.P)  # tokens it holds at least: its prompt, or what it re-prefills after a restart
        self.st = [FUTURE] * n
        self.where: list[str | None] = [None] * n  # the device it physically runs or waits on
        self.first_e = [0] * n  # the epoch it was allocated at
        self.frozen = [0] * n  # tokens generated when it was preempted
        self.qsince = [0.0] * n  # when it started waiting
        self.was_preempted = [False] * n
        self.ver = [0] * n  # bumped when its clock changes: older events are stale
        self.dep_e = [0] * n  # the epoch it departs at
        self.d_first = [0.0] * n
        self.d_after = [0.0] * n
        self.dev: dict[str, _Device] = {}
        self.flights: dict[int, _Flight] = {}
        self.copy_cost: dict[int, tuple[float, int]] = {}  # request in flight -> (link seconds, bytes) if it lands
        self.failed_before: set[int] = set()  # requests whose last move attempt failed (the next is a retry)
        self.mismatch: set[int] = set()  # books and devices disagree (a move not carried out yet)
        self.events: dict[int, list[tuple[int, int, int]]] = {}  # epoch -> (kind, request, version)
        self.arrivals: dict[int, list[int]] = {}
        ea = np.floor(np.asarray(s.arrival_s) / s.epoch_s).astype(np.int64) + 1
        for i, e in enumerate(ea.tolist()):
            self.arrivals.setdefault(e, []).append(i)
        self.stats = MoveStats()
        self.revert = hasattr(policy, "relocate")  # books that are the devices: a failed move is put back
        self.balancer = getattr(policy, "balance", None)
        self.live_bytes = 0  # granules of the running requests
        self.book_bytes = 0  # granules of every request the books hold
        self.decided = self.deferred = self.requeued = self.preemptions = self.held_back = 0
        self.max_round = 0
        self.max_op = 0 if per_op else -1

    # --- a request's clock ------------------------------------------------------------------
    def _generated(self, i: int, now: float) -> int:
        tf = self.TF[i]
        if now < tf:
            return 0
        return min(self.O[i], math.floor((now - tf) / self.step) + 1)

    def _granule(self, tokens: int) -> int:
        return min(-(-tokens // self.G) * self.G, self.cap_tok) * self.bpt

    def _blocks(self, i: int, now: float) -> int:
        """Bytes of the engine's blocks request i holds at `now` (running) or needs (waiting)."""
        if self.st[i] == QUEUED:
            tokens = self.P[i] + self.frozen[i]
        else:
            tokens = max(self.base[i], self.P[i] + self._generated(i, now))
        return min(-(-tokens // self.blk) * self.blk, self.cap_tok) * self.bpt

    def _end(self, i: int) -> float:
        return self.TF[i] + (self.O[i] - 1) * self.step

    def _schedule_events(self, i: int, e: int) -> None:
        """(Re)schedule request i's departure and next granule crossing, from epoch e on (its clock changed)."""
        self.ver[i] += 1
        v = self.ver[i]
        dep = self.dep_e[i] = max(self.first_e[i] + 1, math.floor(self._end(i) / self.E) + 1, e + 1)
        self.events.setdefault(dep, []).append((0, i, v))
        self._schedule_growth(i, e, v)

    def _schedule_growth(self, i: int, e: int, v: int) -> None:
        tokens = self.size[i] // self.bpt  # the granule held: it changes once the tokens pass it
        n_gen = tokens + 1 - self.P[i]
        if tokens < self.cap_tok and n_gen <= self.O[i]:
            t = self.TF[i] + (n_gen - 1) * self.step
            k = max(e + 1, math.ceil(t / self.E) - 1)  # one early: the exact test is made there
            if k < self.dep_e[i]:
                self.events.setdefault(k, []).append((1, i, v))

    def _shift(self, i: int, new_tf: float, e: int, *, started: bool) -> None:
        """Request i's first token (and everything after it) moves to `new_tf`; the delay is TTFT's unless
        the request had `started` (its first token out), then TPOT's."""
        delay = new_tf - self.TF[i]
        if delay > 0:
            if started:
                self.d_after[i] += delay
            else:
                self.d_first[i] += delay
        self.TF[i] = new_tf
        self._schedule_events(i, e)

    def _resume_tf(self, now: float, g: int, tokens: int) -> float:
        """The first-token time that makes a request re-prefilling `tokens` from `now` emit its next token
        (the (g+1)-th) when the prefill is done."""
        return now + self._reprefill_s(tokens) - g * self.step

    def _reprefill_s(self, tokens: int) -> float:
        if self.model is not None:
            return self.model.reprefill_s(max(1, tokens) * self.bpt)
        return tokens * self.s.prefill_s_per_token

    # --- devices ----------------------------------------------------------------------------
    def _device(self, d: str) -> _Device:
        dev = self.dev.get(d)
        if dev is None:
            dev = self.dev[d] = _Device()
        return dev

    def _held_exact(self, d: _Device, now: float) -> int:
        """Bytes of the blocks the device's running requests and incoming copies hold at `now`."""
        P, O, TF, base, step, blk, cap = self.P, self.O, self.TF, self.base, self.step, self.blk, self.cap_tok
        floor = math.floor
        total = 0
        for group in (d.running, d.incoming):
            for i in group:
                tf = TF[i]
                t = P[i] if now < tf else P[i] + min(O[i], floor((now - tf) / step) + 1)
                if t < base[i]:
                    t = base[i]
                b = -(-t // blk) * blk
                total += b if b < cap else cap
        return total * self.bpt

    def _room_for(self, d: _Device, i: int, now: float) -> bool:
        need = self._blocks(i, now)
        return self.C - d.ub >= need or self.C - self._held_exact(d, now) >= need

    def _drop_if_empty(self, d: str | None) -> None:
        dev = self.dev.get(d) if d is not None else None
        if dev is not None and dev.empty() and not dev.out:
            del self.dev[d]

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> FleetResult:
        started = time.perf_counter()
        active: list[int] = []
        used: list[int] = []
        overcommitted = 0
        e = done = 0
        last_arrival = max(self.arrivals, default=0)
        policy = self.policy
        while True:
            now = e * self.E
            self._land(now, e)
            ops: list[Allocate | Depart | Update] = []
            arrived: list[int] = []
            for kind, i, v in sorted(self.events.pop(e, ()), key=lambda x: (x[0], x[1])):
                if v != self.ver[i] or self.st[i] != RUNNING:
                    continue
                if kind == 0:
                    ops.append(Depart(self.ids[i]))
                    self._depart(i, now)
                    done += 1
                else:
                    new = self._granule(max(self.base[i], self.P[i] + self._generated(i, now)))
                    if new > self.size[i]:
                        ops.append(Update(self.ids[i], new))
                        self._resize(i, new)
                    self._schedule_growth(i, e, v)
            for i in self.arrivals.get(e, ()):
                self.size[i] = self._granule(self.P[i] + self._generated(i, now))
                self.ubs[i] = self._ub_bytes(self.size[i])
                self.book_bytes += self.size[i]
                self.first_e[i] = e
                ops.append(Allocate(self.ids[i], self.size[i]))
                arrived.append(i)
            self._tell_held()
            if ops:
                self._batch(ops, arrived, now)
            if self.balancer is not None:
                busy = {d for f in self.flights.values() for d in (f.source, f.destination)}
                lb = self.balancer(busy, self._movable)
                self.max_round = max(self.max_round, len(lb))
                self.decided += len(lb)
                for m in lb:
                    self.mismatch.add(self.index[m.request_id])
            if self.mismatch:
                self._carry_out(now, e)
            self._enforce(now, e)
            books = policy.active_devices()
            phys = [d for d, dev in self.dev.items() if not dev.empty()]
            active.append(len(set(books).union(phys)))
            used.append(self.live_bytes)
            if self.check:
                if ops and sum(policy.used(d) for d in books) != self.book_bytes:
                    raise AssertionError(f"{self.name}: epoch {e}: the books hold "
                                         f"{sum(policy.used(d) for d in books)} B, the requests {self.book_bytes} B")
                if any(self._held_exact(dev, now) > self.C for dev in self.dev.values() if dev.ub > self.C):
                    overcommitted += 1
            if done == self.n and e >= last_arrival:
                break
            e += 1
        st = self.stats
        removed = getattr(policy, "removed_by_batching", 0)
        return FleetResult(
            policy=self.name, active=np.asarray(active, np.int64), moves=st.kv_ok + st.token_moves,
            moves_before_dedup=self.decided + removed, max_moves_per_op=self.max_op,
            overcommitted_epochs=overcommitted, wall_s=time.perf_counter() - started, move_costs=st,
            used_bytes=np.asarray(used, np.int64), requests=self.n, decided=self.decided, removed_by_batching=removed,
            capped_ops=getattr(policy, "capped_operations", 0), kv_migrations=st.kv_ok,
            token_migrations=st.token_moves, deferred=self.deferred, requeued=self.requeued,
            preemptions=self.preemptions, held_back=self.held_back, ttft_delay=np.asarray(self.d_first),
            tpot_delay=np.asarray(self.d_after) / np.maximum(1, np.asarray(self.O) - 1),
            max_moves_per_round=self.max_round)

    # --- the policy ---------------------------------------------------------------------------
    def _tell_held(self) -> None:
        """What each device physically holds for requests the books have elsewhere."""
        held: dict[str, int] = {}
        away = self.mismatch | self.flights.keys()
        if away:
            device_of = self.policy.device_of
            for i in away:
                d = self.where[i]
                if self.st[i] == RUNNING and d is not None and device_of(self.ids[i]) != d:
                    held[d] = held.get(d, 0) + self.size[i]
        hold = getattr(self.policy, "hold", None)
        if hold is not None:
            hold(held)
        elif hasattr(self.policy, "held"):
            self.policy.held = held

    def _batch(self, ops: list, arrived: list[int], now: float) -> None:
        policy = self.policy
        if self.per_op:
            placements: dict[str, str] = {}
            moves = []
            for op in ops:
                if type(op) is Depart:
                    r = policy.depart(op.request_id)
                elif type(op) is Update:
                    r = policy.update(op.request_id, op.size)
                else:
                    r = policy.allocate(op.request_id, op.size)
                    placements.update(r.placements)
                self.max_op = max(self.max_op, len(r.moves))
                moves.extend(r.moves)
        else:
            r = policy.run_batch(ops)
            placements, moves = r.placements, r.moves
        self.decided += len(moves)
        for i in arrived:
            d = placements.get(self.ids[i]) or policy.device_of(self.ids[i])
            assert d, f"{self.name}: {self.ids[i]} was not placed"
            self.where[i] = d
            self.frozen[i] = self._generated(i, now)  # what it holds once admitted (its clock stops while it waits)
            self.st[i] = QUEUED
            self.qsince[i] = now
            insort(self._device(d).queue, i)
        for m in moves:
            i = self.index[m.request_id]
            if self.st[i] in (RUNNING, QUEUED):
                self.mismatch.add(i)

    def _movable(self, rid: str) -> bool:
        i = self.index[rid]
        return self.st[i] == RUNNING and i not in self.flights and i not in self.mismatch

    # --- what requests do on the devices ---------------------------------------------------------
    def _resize(self, i: int, new: int) -> None:
        delta = new - self.size[i]
        self.size[i] = new
        self.live_bytes += delta
        self.book_bytes += delta
        ub = self._ub_bytes(new)
        ub_delta, self.ubs[i] = ub - self.ubs[i], ub
        self._device(self.where[i]).ub += ub_delta
        f = self.flights.get(i)
        if f is not None:
            self._device(f.destination).ub += ub_delta

    def _ub_bytes(self, granule_bytes: int) -> int:
        """A granule in whole blocks: what a request holding at most that many tokens can hold in blocks."""
        tokens = granule_bytes // self.bpt
        return min(-(-tokens // self.blk) * self.blk, self.cap_tok) * self.bpt

    def _depart(self, i: int, now: float) -> None:
        f = self.flights.get(i)
        if f is not None:
            self._fail(f, "request ended", put_back=False)
        d = self._device(self.where[i])
        d.running.discard(i)
        d.ub -= self.ubs[i]
        self.live_bytes -= self.size[i]
        self.book_bytes -= self.size[i]
        self.st[i] = DONE
        self.mismatch.discard(i)
        self.failed_before.discard(i)
        self._drop_if_empty(self.where[i])

    def _preempt(self, i: int, now: float) -> None:
        f = self.flights.get(i)
        if f is not None:
            self._fail(f, "preempted on the source", put_back=True)
        d = self._device(self.where[i])
        self.frozen[i] = max(self.base[i], self.P[i] + self._generated(i, now)) - self.P[i]
        self.was_preempted[i] = True
        d.running.discard(i)
        d.ub -= self.ubs[i]
        self.live_bytes -= self.size[i]
        self.st[i] = QUEUED
        self.qsince[i] = now
        self.ver[i] += 1  # no departure or growth while it waits
        insort(d.queue, i)
        self.preemptions += 1

    def _admit(self, i: int, d: _Device, now: float, e: int) -> None:
        d.running.add(i)
        d.ub += self.ubs[i]
        self.live_bytes += self.size[i]
        self.st[i] = RUNNING
        if self.was_preempted[i]:  # recompute: prompt + what it had generated, then its next token
            g = self.frozen[i]
            self.frozen[i] = 0
            self.base[i] = self.P[i] + g
            self.was_preempted[i] = False
            self._shift(i, max(self.TF[i], self._resume_tf(now, g, self.P[i] + g)), e, started=g > 0)
        else:
            self.frozen[i] = 0
            if now > self.qsince[i]:  # an arrival held back: it starts as late as it waited
                self.held_back += 1
                self._shift(i, self.TF[i] + (now - self.qsince[i]), e, started=False)
            else:
                self._schedule_events(i, e)

    def _enforce(self, now: float, e: int) -> None:
        """Preempt what outgrew a device (newest first), then admit its waiting requests (FCFS)."""
        C = self.C
        for dev in list(self.dev.values()):
            held = -1
            if dev.ub > C:
                held = self._held_exact(dev, now)
                if held > C:
                    for i in sorted(dev.running, key=lambda i: (i in dev.out, -i)):
                        if held <= C:
                            break
                        held -= self._blocks(i, now)
                        self._preempt(i, now)
            if dev.queue:
                exact = held >= 0
                free = C - (held if exact else dev.ub)
                while dev.queue:
                    i = dev.queue[0]
                    need = self._blocks(i, now)
                    if need > free and not exact:  # the granules said no: ask the blocks
                        free = C - self._held_exact(dev, now)
                        exact = True
                    if need > free:
                        break
                    dev.queue.pop(0)
                    free -= need
                    self._admit(i, dev, now, e)

    # --- moves ----------------------------------------------------------------------------------
    def _carry_out(self, now: float, e: int) -> None:
        device_of = self.policy.device_of
        cands: list[tuple[int, str, str]] = []
        for i in sorted(self.mismatch):
            target = device_of(self.ids[i]) if self.st[i] in (RUNNING, QUEUED) else None
            src = self.where[i]
            if target is None or target == src:
                self.mismatch.discard(i)
                continue
            if i in self.flights:
                continue  # it moves on once this copy lands
            if self.st[i] == QUEUED:  # waiting for memory: no KV to carry, it waits there instead
                self._device(src).queue.remove(i)
                insort(self._device(target).queue, i)
                self.where[i] = target
                self.mismatch.discard(i)
                self.requeued += 1
                self._drop_if_empty(src)
                continue
            cands.append((i, src, target))
        if not cands:
            return
        modes = self._choose_modes(cands, now) if self.mode == "auto" else dict.fromkeys(
            (i for i, _, _ in cands), self.mode)
        if self.model is None:  # instant moves: one may make room for another, so try again until none can
            while True:
                fits = [c for c in cands if modes[c[0]] != "defer" and self._room_for(self._device(c[2]), c[0], now)]
                if not fits:
                    break
                for i, src, dst in fits:
                    self.mismatch.discard(i)
                    self._start_copy(i, src, dst, now, e) if modes[i] == "kv" else self._token_move(i, src, dst, now, e)
                cands = [c for c in cands if c not in fits]
        for i, src, dst in cands:
            mode = modes[i]
            if mode == "defer":
                self.deferred += 1
                continue
            self.mismatch.discard(i)
            if i in self.failed_before:
                self.stats.retries += 1
            if not self._room_for(self._device(dst), i, now):
                self._refused(i, src, mode)
            elif mode == "kv":
                self._start_copy(i, src, dst, now, e)
            else:
                self._token_move(i, src, dst, now, e)

    def _choose_modes(self, cands: list[tuple[int, str, str]], now: float) -> dict[int, str]:
        """MELL §V: pack this interval's moves into the interfaces' bytes (KV) and the destinations' spare
        prefill tokens (tokens); what fits neither is deferred."""
        b = self.budgets
        assert b is not None
        E = self.E
        out: dict[str, float] = {}
        inn: dict[str, float] = {}
        pre: dict[str, float] = {}
        cs = [MigrationCandidate(self.ids[i], src, dst, kv_bytes=self._blocks(i, now),
                                 tokens=self.P[i] + self._generated(i, now)) for i, src, dst in cands]
        for c in cs:
            ds, dd = self._device(c.source), self._device(c.destination)
            out[c.source] = b.link_bytes_per_s * max(0.0, E - max(0.0, ds.nic_out - now))
            inn[c.destination] = b.link_bytes_per_s * max(0.0, E - max(0.0, dd.nic_in - now))
            tokens = b.prefill_tokens_per_s * max(0.0, E - max(0.0, dd.prefill_busy - now))
            if dd.prefill_busy <= now and tokens > 0:  # an idle destination takes one re-prefill longer than an
                tokens = max(tokens, c.tokens, pre.get(c.destination, 0.0))  # interval's spare compute (it runs on)
            pre[c.destination] = max(tokens, pre.get(c.destination, 0.0))
        links = {(c.source, c.destination): INF for c in cs}
        choices = choose_migration_modes(cs, links, pre, "auto", egress_budget_bytes=out, ingress_budget_bytes=inn)
        return {self.index[c.request_id]: c.mode for c in choices}

    def _refused(self, i: int, src: str, mode: str) -> None:
        """The destination has no room now: nothing moves."""
        if mode == "kv":
            self.stats.kv_moves += 1
        self.stats.failed["destination full"] += 1
        self.failed_before.add(i)
        if self.revert:
            self.policy.relocate(self.ids[i], src)
        else:
            self.mismatch.add(i)  # MELL's coordinator re-issues it the next interval

    def _start_copy(self, i: int, src: str, dst: str, now: float, e: int) -> None:
        ds, dd = self._device(src), self._device(dst)
        self.stats.kv_moves += 1
        if self.model is None:  # no costs: the hand-over is immediate
            f = _Flight(i, src, dst, now, True, 0.0)
            self.flights[i] = f
            ds.out.add(i)
            dd.incoming.add(i)
            dd.ub += self.ubs[i]
            self._hand_over(f, now, e)
            return
        nbytes = self._blocks(i, now)
        pc = self.model.precopy(nbytes)
        start = max(now, ds.nic_out, dd.nic_in)  # one copy at a time per interface and direction
        if pc.ok:
            f = _Flight(i, src, dst, start + pc.total_s, True, pc.stall_s)
            self.copy_cost[i] = (pc.total_s, pc.blocks * self.model.block_size * self.bpt)
        else:
            f = _Flight(i, src, dst, start + pc.precopy_s, False, 0.0, "did not converge")
        ds.nic_out = dd.nic_in = f.done_s
        self.flights[i] = f
        ds.out.add(i)
        dd.incoming.add(i)
        dd.ub += self.ubs[i]

    def _land(self, now: float, e: int) -> None:
        """Copies whose hand-over (or failure) time has come."""
        if not self.flights:
            return
        for f in sorted((f for f in self.flights.values() if f.done_s <= now), key=lambda f: (f.done_s, f.request)):
            if not f.ok:
                self._fail(f, f.reason, put_back=True)
            elif self._end(f.request) < f.done_s:
                self._fail(f, "request ended", put_back=True)
            else:
                self._hand_over(f, now, e)

    def _hand_over(self, f: _Flight, now: float, e: int) -> None:
        i = f.request
        del self.flights[i]
        ds, dd = self._device(f.source), self._device(f.destination)
        ds.out.discard(i)
        ds.running.discard(i)
        ds.ub -= self.ubs[i]
        dd.incoming.discard(i)
        dd.running.add(i)
        self.where[i] = f.destination
        st = self.stats
        st.kv_ok += 1
        copy_s, nbytes = self.copy_cost.pop(i, (0.0, 0))
        st.copy_s += copy_s
        st.bytes_copied += nbytes
        self.failed_before.discard(i)
        if f.stall_s > 0:
            st.stalls.append(f.stall_s)
            st.delay[self.ids[i]] = st.delay.get(self.ids[i], 0.0) + f.stall_s
            self._shift(i, self.TF[i] + f.stall_s, e, started=self._generated(i, f.done_s) > 0)
        if self.policy.device_of(self.ids[i]) != f.destination:
            self.mismatch.add(i)  # the books moved it on meanwhile
        self._drop_if_empty(f.source)

    def _fail(self, f: _Flight, reason: str, *, put_back: bool) -> None:
        """A copy that ends without a hand-over: the destination's reservation is freed, the request is
        where it was."""
        i = f.request
        del self.flights[i]
        self.copy_cost.pop(i, None)
        ds, dd = self._device(f.source), self._device(f.destination)
        ds.out.discard(i)
        dd.incoming.discard(i)
        dd.ub -= self.ubs[i]
        self.stats.failed[reason] += 1
        self.failed_before.add(i)
        if put_back:
            if not self.revert:
                self.mismatch.add(i)  # retried the next interval
            elif self.policy.device_of(self.ids[i]) == f.destination:
                self.policy.relocate(self.ids[i], f.source)
        self._drop_if_empty(f.destination)

    def _token_move(self, i: int, src: str, dst: str, now: float, e: int) -> None:
        """Token mode: the source drops the KV at once, the destination re-prefills the context."""
        ds, dd = self._device(src), self._device(dst)
        g = self._generated(i, now)
        tokens = max(self.base[i], self.P[i] + g)
        r = self._reprefill_s(tokens)
        self.base[i] = tokens
        ds.running.discard(i)
        ds.ub -= self.ubs[i]
        dd.running.add(i)
        dd.ub += self.ubs[i]
        self.where[i] = dst
        dd.prefill_busy = max(dd.prefill_busy, now) + r
        st = self.stats
        st.token_moves += 1
        st.recompute_s += r
        st.delay[self.ids[i]] = st.delay.get(self.ids[i], 0.0) + r
        self.failed_before.discard(i)
        self._shift(i, max(self.TF[i], self._resume_tf(now, g, tokens)), e, started=g > 0)
        self._drop_if_empty(src)


def fleet_utilisation(result: FleetResult, capacity: int) -> float:
    """Time-averaged share of the active devices' KV memory the running requests hold (granules)."""
    provisioned = float(result.active.sum()) * capacity
    return float(result.used_bytes.sum()) / provisioned if provisioned and result.used_bytes is not None else 0.0


__all__ = ["Budgets", "FleetResult", "fleet_utilisation", "run_fleet"]
