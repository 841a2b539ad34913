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
- GPUs (MELL's y, Eq. 3) come from the placement: a device counts as active while the books have it.
  Beside it, `active_physical`: the devices that also hold something physically (a copy still being
  drained, a reservation, a request waiting). `LoadBalance.balance` runs after each batch with the
  devices that have a migration in flight excluded (the concurrency limit).
- A fixed pool (`pool=N`): the policy gets the device list gpu-0..gpu-N-1 and `when_full="wait"`; an
  arrival that fits on none of them is refused and waits (first come, first served, offered again
  every interval at the size it arrived with; the wait is its TTFT's), a growth that fits nowhere stays
  over C and the device's engine preempts. `tidal repro mell` bisects N for the smallest pool that
  meets its SLO.
"""
from __future__ import annotations

import math
import time

import numpy as np

from loadgen.sim.kv_packing import Schedule
from loadgen.sim.kv_packing_fleet_engine import FleetEngine
from loadgen.sim.kv_packing_fleet_moves import FleetMoves
from loadgen.sim.kv_packing_fleet_policy import FleetPolicy
from loadgen.sim.kv_packing_fleet_state import FUTURE, QUEUED, RUNNING, Budgets, Device, FleetResult, Flight
from loadgen.sim.kv_packing_moves import MoveModel, MoveStats
from shared.policy.mell_ops import Allocate, Depart, Update


def pool_devices(n: int) -> list[str]:
    return [f"gpu-{k}" for k in range(n)]


def run_fleet(schedule: Schedule, policy, name: str, *, moves: MoveModel | None = None, mode: str = "kv",
              budgets: Budgets | None = None, per_op: bool = False, check: bool = True,
              pool: int | None = None, abort_late: tuple[float, float, int] | None = None) -> FleetResult:
    """Play `schedule`'s requests on `policy`'s books and simulated devices (module docstring). `mode`: how
    the policy's moves travel ("kv", "tokens", or "auto" = adaptive under `budgets`); `per_op`: ops one by one
    (measures the most moves one operation decides); `abort_late` = (TTFT s, TPOT s per token, k): stop once
    k requests are past either target (their delays only grow: the run's percentile is decided)."""
    if schedule.prompt is None or schedule.first_token_s is None:
        raise ValueError(f"{name}: the fleet needs a schedule with its requests (kv_packing.build_schedule)")
    if mode not in ("kv", "tokens", "auto"):
        raise ValueError(f"mode must be kv, tokens or auto, got {mode!r}")
    if mode == "auto" and budgets is None:
        raise ValueError(f"{name}: adaptive migration needs budgets")
    if pool is not None:
        policy.when_full = "wait"  # the policy was built on pool_devices(pool)
    fleet = _Fleet(schedule, policy, name, moves, mode, budgets, per_op, check)
    fleet.abort_late = abort_late
    return fleet.run()


class _Fleet(FleetEngine, FleetMoves):
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
        self.dev: dict[str, Device] = {}
        self.flights: dict[int, Flight] = {}
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
        self.pool_wait: list[int] = []  # arrivals refused by a full pool, first come first served
        self.offered: dict[int, tuple[float, int, int]] = {}  # refused arrival -> (first offered, size, frozen)
        self.refused = 0  # arrival-intervals refused by a full pool
        self.abort_late: tuple[float, float, int] | None = None  # (TTFT s, TPOT s, k): stop once k are past either
        self.n_late = 0  # requests whose TTFT added passed abort_late's
        self.n_slow = 0  # requests whose TPOT added (seconds after the first token / later tokens) passed it
        self.bridge = FleetPolicy(
            policy, name, ids=self.ids, index=self.index, st=self.st, where=self.where, size=self.size,
            frozen=self.frozen, qsince=self.qsince, mismatch=self.mismatch, flights=self.flights,
            offered=self.offered, generated=self._generated, device=self._device, per_op=per_op)

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
                before = self.d_after[i]
                self.d_after[i] += delay
                if self.abort_late is not None:
                    limit = self.abort_late[1] * max(1, self.O[i] - 1)
                    if before <= limit < self.d_after[i]:
                        self.n_slow += 1
            else:
                before = self.d_first[i]
                self.d_first[i] += delay
                if self.abort_late is not None and before <= self.abort_late[0] < self.d_first[i]:
                    self.n_late += 1
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
    def _device(self, d: str) -> Device:
        dev = self.dev.get(d)
        if dev is None:
            dev = self.dev[d] = Device()
        return dev

    def _held_exact(self, d: Device, now: float) -> int:
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

    def _room_for(self, d: Device, i: int, now: float) -> bool:
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
        physical: list[int] = []
        used: list[int] = []
        overcommitted = 0
        aborted = False
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
            waiting, self.pool_wait = self.pool_wait, []
            for i in (*waiting, *self.arrivals.get(e, ())):
                first = self.offered.get(i)
                self.size[i] = first[1] if first else self._granule(self.P[i] + self._generated(i, now))
                self.ubs[i] = self._ub_bytes(self.size[i])
                self.book_bytes += self.size[i]
                self.first_e[i] = e
                ops.append(Allocate(self.ids[i], self.size[i]))
                arrived.append(i)
            self.bridge.tell_held()
            if ops:
                self._batch(ops, arrived, now)
            if self.balancer is not None:
                busy = {d for f in self.flights.values() for d in (f.source, f.destination)}
                lb = self.balancer(busy, self.bridge.movable)
                self.max_round = max(self.max_round, len(lb))
                self.decided += len(lb)
                for m in lb:
                    self.mismatch.add(self.index[m.request_id])
            if self.mismatch:
                self._carry_out(now, e)
            self._enforce(now, e)
            books = policy.active_devices()
            phys = [d for d, dev in self.dev.items() if not dev.empty() or dev.out]
            active.append(len(books))
            physical.append(len(set(books).union(phys)))
            used.append(self.live_bytes)
            if self.check:
                if ops and sum(policy.used(d) for d in books) != self.book_bytes:
                    raise AssertionError(f"{self.name}: epoch {e}: the books hold "
                                         f"{sum(policy.used(d) for d in books)} B, the requests {self.book_bytes} B")
                if any(self._held_exact(dev, now) > self.C for dev in self.dev.values() if dev.ub > self.C):
                    overcommitted += 1
            if done == self.n and e >= last_arrival and not self.pool_wait:
                break
            if self.abort_late is not None and max(self._late(now), self.n_slow) >= self.abort_late[2]:
                aborted = True  # the SLO is already missed: the rest would not change that
                break
            e += 1
        st = self.stats
        removed = getattr(policy, "removed_by_batching", 0)
        return FleetResult(
            policy=self.name, active=np.asarray(active, np.int64), moves=st.kv_ok + st.token_moves,
            moves_before_dedup=self.decided + removed, max_moves_per_op=self.bridge.max_op,
            overcommitted_epochs=overcommitted, wall_s=time.perf_counter() - started, move_costs=st,
            used_bytes=np.asarray(used, np.int64), requests=self.n, decided=self.decided, removed_by_batching=removed,
            capped_ops=getattr(policy, "capped_operations", 0), kv_migrations=st.kv_ok,
            token_migrations=st.token_moves, deferred=self.deferred, requeued=self.requeued,
            preemptions=self.preemptions, held_back=self.held_back, ttft_delay=np.asarray(self.d_first),
            tpot_delay=np.asarray(self.d_after) / np.maximum(1, np.asarray(self.O) - 1),
            max_moves_per_round=self.max_round, active_physical=np.asarray(physical, np.int64),
            max_items_per_op=self.bridge.max_op_items, refused=self.refused, aborted=aborted)

    def _batch(self, ops: list, arrived: list[int], now: float) -> None:
        """The policy decides `ops` (the bridge places what it admitted); a refused arrival waits for the pool."""
        decided, refused = self.bridge.batch(ops, arrived, now)
        self.decided += decided
        for i in refused:
            self.book_bytes -= self.size[i]
            self.refused += 1
            self.offered.setdefault(i, (now, self.size[i], self._generated(i, now)))
            self.pool_wait.append(i)

    def _late(self, now: float) -> int:
        """Requests whose first token is already later than `abort_late`'s TTFT allows."""
        limit = self.abort_late[0]
        return self.n_late + sum(1 for i in self.pool_wait if now - self.offered[i][0] > limit)


def fleet_utilisation(result: FleetResult, capacity: int) -> float:
    """Time-averaged share of the active devices' KV memory the running requests hold (granules)."""
    provisioned = float(result.active.sum()) * capacity
    return float(result.used_bytes.sum()) / provisioned if provisioned and result.used_bytes is not None else 0.0


__all__ = ["Budgets", "FleetResult", "fleet_utilisation", "run_fleet"]
