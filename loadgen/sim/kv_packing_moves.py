"""What a move costs in the KV-packing simulation: every policy's moves (MELL's, LB's, the restart
ablations') go through the one movement cost model (shared/policy/movement.py), charged alike.

A policy decides a move of request r (KV size s) from device A to B at a planning boundary t and
books r on B at once. The ledger below is what physically happens:

- KV mode (migrating policies): Llumnix's multi-stage pre-copy over the profile's kv link
  (`MovementCosts.kv_precopy` of r's context, the profile's blocks, the decode step). B holds r's
  KV from t (the policy's books: the reservation for the whole copy); A keeps r's KV until the
  hand-over at t + precopy + stall, so A stays occupied (an active GPU, its bytes counted) and r
  stalls for the last stage (added to r's latency).
- It fails - nothing moves, B's reservation is freed, r keeps decoding on A - when the pre-copy
  does not converge within the stage limit, when r ends before the hand-over, or when B has no
  physical room at t (its own outgoing copies still hold memory). The packing policies keep their
  books and have no undo, so the move is re-issued at the next planning boundary toward where the
  policy has r (Llumnix's coordinator retries); until one succeeds r stays physically on A.
- A second move of r while its copy runs waits for that copy's hand-over (or failure).
- Token mode (the restart ablations, `Migrate(mode="tokens")`): A drops r's KV at once and B
  re-prefills r's context: r stalls for that prefill (the profile's step cost of one
  whole-context prefill); no link time, it cannot fail.

The stalls do not shift the op stream (request lifetimes stay placement-independent, as the module
docstring of kv_packing.py says): a last stage takes tens of milliseconds (about 0.1 s at most on
the testbeds' 10 Gbps) against a 1 s planning interval; the report gives each request's largest
total delay. The policies plan on their books, not on memory a
copy still holds: the ledger counts the epochs where that physically overcommits a device. (The fleet
simulation, kv_packing_fleet.py, closes both gaps: it shifts each request by what it waited and tells the
policies what a copy still holds; `tidal repro mell` runs its arms there and this ledger only for the
op-stream paths: the hindsight arms and MELL through the planner core.)
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from loadgen.sim.profile import StepCost
from shared.policy.movement import MovementCosts, Precopy


@dataclass(frozen=True)
class MoveModel:
    """The costs one testbed's moves pay (from its cost profile)."""

    costs: MovementCosts
    bytes_per_token: int
    block_size: int  # tokens per KV block (the pre-copy moves whole blocks)
    decode_step_s: float  # the source keeps decoding one token per step during the copy
    prefill: StepCost  # the destination's re-prefill in token mode

    def __post_init__(self) -> None:
        if self.bytes_per_token < 1 or self.block_size < 1 or self.decode_step_s <= 0:
            raise ValueError(f"MoveModel: bytes_per_token and block_size must be >= 1 and decode_step_s > 0 "
                             f"(got {self.bytes_per_token}, {self.block_size}, {self.decode_step_s})")

    def precopy(self, size: int) -> Precopy:
        return self.costs.kv_precopy(max(1, size // self.bytes_per_token), self.block_size,
                                     self.block_size * self.bytes_per_token, self.decode_step_s)

    def reprefill_s(self, size: int) -> float:
        n = max(1, size // self.bytes_per_token)
        return self.prefill.step_s(0, 0, n, n * n)


@dataclass
class MoveStats:
    kv_moves: int = 0  # KV migrations started (retries included)
    kv_ok: int = 0
    failed: Counter = field(default_factory=Counter)  # reason -> count
    retries: int = 0  # failed moves re-issued
    token_moves: int = 0
    copy_s: float = 0.0  # link time of successful copies (pre-copy + last stage)
    bytes_copied: int = 0
    recompute_s: float = 0.0  # token mode: re-prefill time
    stalls: list[float] = field(default_factory=list)  # per successful KV move: the last stage
    delay: dict[str, float] = field(default_factory=dict)  # request -> time it ran nowhere (stalls + re-prefills)
    physical_overcommitted_epochs: int = 0  # a device held more than its capacity counting in-flight copies
    overcommit_max_bytes: int = 0  # the most one device held beyond its capacity

    def summary(self) -> dict:
        delays = np.fromiter(self.delay.values(), float, len(self.delay))
        return {"kv_moves": self.kv_moves, "kv_ok": self.kv_ok, "failed": dict(self.failed), "retries": self.retries,
                "token_moves": self.token_moves, "copy_s": self.copy_s, "bytes_copied": self.bytes_copied,
                "recompute_s": self.recompute_s, "stall_p99_s": float(np.percentile(self.stalls, 99)) if self.stalls
                else 0.0, "delay_max_s": float(delays.max(initial=0.0)), "delayed_requests": len(self.delay),
                "physical_overcommitted_epochs": self.physical_overcommitted_epochs,
                "overcommit_max_bytes": self.overcommit_max_bytes}


@dataclass
class _Flight:
    source: str  # where r physically is until the hand-over (or for good, on failure)
    destination: str
    ends_at: float  # hand-over (ok) or failure time
    ok: bool
    reason: str = ""


class MoveLedger:
    """Physical state beyond a policy's books: copies in flight and failed moves awaiting a retry."""

    def __init__(self, model: MoveModel, capacity: int, end_s: Callable[[str], float]) -> None:
        self.model = model
        self.capacity = capacity
        self.end_s = end_s  # when a request's last token is out (it cannot be handed over after)
        self.stats = MoveStats()
        self._flights: dict[str, _Flight] = {}
        self._stranded: dict[str, tuple[str, str]] = {}  # failed move: request -> (where it is, where booked)
        self._size: dict[str, int] = {}  # current KV size of the requests in flight or stranded
        self._extra: dict[str, int] = {}  # device -> bytes there beyond the books (negative: booked, not there)
        self._precopy: dict[int, Precopy] = {}

    # --- the op stream -------------------------------------------------------------------
    def update(self, rid: str, size: int) -> None:
        old = self._size.get(rid)
        if old is None:
            return
        self._size[rid] = size  # in place: retries keep the order the moves failed in
        flight, stranded = self._flights.get(rid), self._stranded.get(rid)
        if flight is not None:
            self._add(flight.source, size - old)
        if stranded is not None:
            self._add(stranded[0], size - old)
            self._add(stranded[1], old - size)

    def depart(self, rid: str) -> None:
        if rid in self._size:
            self._untrack(rid)

    # --- bookkeeping of what is physically where ------------------------------------------
    def _add(self, device: str, nbytes: int) -> None:
        left = self._extra.get(device, 0) + nbytes
        if left:
            self._extra[device] = left
        else:
            self._extra.pop(device, None)

    def _track(self, rid: str, size: int, flight: _Flight | None, stranded: tuple[str, str] | None) -> None:
        self._size[rid] = size
        if flight is not None:
            self._flights[rid] = flight
            self._add(flight.source, size)  # the destination's reservation is on the books already
        if stranded is not None:
            self._stranded[rid] = stranded
            self._add(stranded[0], size)
            self._add(stranded[1], -size)  # its reservation there was freed

    def _untrack(self, rid: str) -> tuple[_Flight | None, tuple[str, str] | None]:
        size = self._size.pop(rid)
        flight, stranded = self._flights.pop(rid, None), self._stranded.pop(rid, None)
        if flight is not None:
            self._add(flight.source, -size)
        if stranded is not None:
            self._add(stranded[0], -size)
            self._add(stranded[1], size)
        return flight, stranded

    # --- moves ---------------------------------------------------------------------------
    def move(self, rid: str, size: int, source: str, destination: str, now: float, *, kv: bool,
             used: Callable[[str], int]) -> None:
        """A move the policy decided at `now` (its books already hold r on `destination`)."""
        start = now
        if rid in self._size:
            flight, stranded = self._untrack(rid)
            if flight is not None:  # the new move starts when this copy hands over or fails
                start, source = max(now, flight.ends_at), flight.destination if flight.ok else flight.source
            elif stranded is not None:
                source = stranded[0]
        if source == destination:
            return  # r is already there (a round trip, or a retry overtaken)
        if not kv:
            delay = self.model.reprefill_s(size)
            self.stats.token_moves += 1
            self.stats.recompute_s += delay
            self.stats.delay[rid] = self.stats.delay.get(rid, 0.0) + delay
            return
        self._kv_move(rid, size, source, destination, start, used)

    def _kv_move(self, rid: str, size: int, source: str, destination: str, start: float,
                 used: Callable[[str], int]) -> None:
        pc = self._precopy.get(size)
        if pc is None:
            pc = self._precopy[size] = self.model.precopy(size)
        self.stats.kv_moves += 1
        end = self.end_s(rid)
        if used(destination) + self._extra.get(destination, 0) > self.capacity:
            flight = _Flight(source, destination, start, False, "destination full")
        elif not pc.ok:
            flight = _Flight(source, destination, start + pc.precopy_s, False, "did not converge")
        elif end < start + pc.total_s:
            flight = _Flight(source, destination, max(start, end), False, "request ended")
        else:
            flight = _Flight(source, destination, start + pc.total_s, True)
            self.stats.kv_ok += 1
            self.stats.copy_s += pc.total_s
            self.stats.bytes_copied += pc.blocks * self.model.block_size * self.model.bytes_per_token
            self.stats.stalls.append(pc.stall_s)
            self.stats.delay[rid] = self.stats.delay.get(rid, 0.0) + pc.stall_s
        if flight.ok:
            self._track(rid, size, flight, None)
            return
        self.stats.failed[flight.reason] += 1
        if flight.ends_at <= start:
            self._track(rid, size, None, (source, destination))  # refused at once: B never held anything
        else:
            self._track(rid, size, flight, None)  # B holds the reservation until the copy fails

    def advance(self, now: float) -> None:
        """Copies that ended by `now`: handed over, or failed (r stays on its source)."""
        for rid in [r for r, f in self._flights.items() if f.ends_at <= now]:
            size = self._size[rid]
            flight, _ = self._untrack(rid)
            assert flight is not None
            if not flight.ok:
                self._track(rid, size, None, (flight.source, flight.destination))

    def retry(self, now: float, booked: Callable[[str], str | None], used: Callable[[str], int]) -> None:
        """Re-issue the failed moves toward where the policy has each request now."""
        for rid in list(self._stranded):
            target = booked(rid)
            if target is None:
                continue
            self.stats.retries += 1
            self.move(rid, self._size[rid], self._stranded[rid][0], target, now, kv=True, used=used)

    # --- queries -------------------------------------------------------------------------
    def stranded_at(self, rid: str) -> str | None:
        """Where a request whose move failed physically is (None: not stranded)."""
        where = self._stranded.get(rid)
        return None if where is None else where[0]

    def in_flight(self, rid: str) -> bool:
        return rid in self._flights

    def held(self, device: str, used: Callable[[str], int]) -> int:
        """Bytes physically on `device`: its books plus copies still leaving it, less reservations freed."""
        return used(device) + self._extra.get(device, 0)

    def occupancy(self, active: Iterable[str], used: Callable[[str], int]) -> tuple[int, bool]:
        """(devices physically in use, whether one holds more than its capacity) after the books' `active`."""
        extra = self._extra
        devices = set(active) | {d for d, b in extra.items() if b > 0}
        excess = max((used(d) + extra.get(d, 0) - self.capacity for d in devices), default=0)
        if excess > 0:
            self.stats.physical_overcommitted_epochs += 1
            self.stats.overcommit_max_bytes = max(self.stats.overcommit_max_bytes, excess)
        return len(devices), excess > 0


def request_end_times(end_s: np.ndarray) -> Callable[[str], float]:
    """The schedule's request ids are r<index>."""
    return lambda rid: float(end_s[int(rid[1:])])


__all__ = ["MoveLedger", "MoveModel", "MoveStats", "request_end_times"]
