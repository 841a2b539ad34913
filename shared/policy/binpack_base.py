"""Bookkeeping shared by the bin-packing baselines of MELL's evaluation (binpack_baselines.py).

Same operation API as `MellScheduler` (allocate / depart / update / run_batch, returning
placements and moves), so the simulator drives all policies alike. Each request has a current
size (the KV it holds: `used`) and a charge (what it holds against its device's capacity:
its current size, or more where a policy reserves memory for growth at admission). Fit
decisions compare charges with capacity; `used` reports only the bytes in use, so a
reservation shows up as reserved-but-unused memory.

A device whose charges exceed its capacity is relieved by `_relieve`. By default nothing is done
in the books: the device's engine preempts its newest requests and they wait there for memory
(the KV-packing fleet simulation, loadgen/sim/kv_packing_fleet.py, plays that out), so the books of
such a policy may hold more than C on a device, and no arrival is put there while they do. The
restart ablation (binpack_baselines.py) re-places the preempted requests elsewhere instead.

`held` (device -> bytes, set by the simulator) is memory a device physically holds beyond the books
(a copy of a request the books have moved away, not handed over yet): fit decisions leave it alone.
`relocate` puts a request back on a device (a migration that failed).
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.mell_ops import Allocate, BatchResult, Depart, Move, NoCapacity, Op, OpResult, Update


class BinPackPolicy:
    """Shared state; subclasses choose devices (`_choose`) and may override the charge and overload hooks."""

    name = "base"
    migrates = False  # whether moves are KV migrations (True) or preempt-and-recompute restarts

    def __init__(self, capacity: int, devices: Sequence[str] | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._allowed = list(devices) if devices is not None else None
        self._minted = 0
        self._size: dict[str, int] = {}  # request -> bytes in use
        self._loc: dict[str, str] = {}
        self._seq: dict[str, int] = {}  # arrival order, for newest-first preemption
        self._arrivals = 0
        self._members: dict[str, dict[str, int]] = {}  # active device -> request -> charge
        self._load: dict[str, int] = {}  # active device -> sum of charges (what fit decisions see)
        self._bytes: dict[str, int] = {}  # active device -> bytes in use
        self._order: list[str] = []  # active devices in activation order (deterministic ties)
        self.held: dict[str, int] = {}  # device -> bytes it physically holds beyond the books (see the docstring)
        self.when_full = "raise"  # "wait": a batch's arrival that fits no device of the list is refused (it waits)
        self.refused: list[str] = []  # arrivals the last batch refused (when_full="wait")

    # --- queries -------------------------------------------------------------------------
    def device_of(self, request_id: str) -> str | None:
        return self._loc.get(request_id)

    def requests_on(self, device: str) -> dict[str, int]:
        """Request -> bytes in use on `device`."""
        return {rid: self._size[rid] for rid in self._members.get(device, {})}

    def active_devices(self) -> list[str]:
        return list(self._order)

    def used(self, device: str) -> int:
        """KV bytes in use on `device` (reservations not included)."""
        return self._bytes.get(device, 0)

    def charged(self, device: str) -> int:
        """Bytes held against `device`'s capacity: in use plus reserved for growth."""
        return self._load.get(device, 0)

    # --- operations ----------------------------------------------------------------------
    def allocate(self, request_id: str, size: int) -> OpResult:
        if request_id in self._loc:
            raise ValueError(f"allocate: request {request_id!r} is already placed on {self._loc[request_id]}")
        self._check_size(request_id, size)
        charge = self._admission_charge(request_id, size)
        self._seq[request_id] = self._arrivals
        self._arrivals += 1
        device = self._choose(charge, exclude=None) or self._activate(request_id, charge)
        self._add(request_id, size, device, charge)
        return OpResult(placements={request_id: device}, moves=())

    def depart(self, request_id: str) -> OpResult:
        device = self._known(request_id, "depart")
        self._remove(request_id, device)
        del self._size[request_id], self._loc[request_id], self._seq[request_id]
        return OpResult(placements={}, moves=())

    def update(self, request_id: str, size: int) -> OpResult:
        device = self._known(request_id, "update")
        self._check_size(request_id, size)
        charge = self._growth_charge(request_id, size, self._members[device][request_id])
        self._bytes[device] += size - self._size[request_id]
        self._size[request_id] = size
        self._load[device] += charge - self._members[device][request_id]
        self._members[device][request_id] = charge
        moves: list[Move] = []
        if self._load[device] > self.capacity:
            self._relieve(device, moves)
        return OpResult(placements={}, moves=tuple(moves))

    def relocate(self, request_id: str, device: str) -> None:
        """Put a request back on `device` in the books (a failed migration: it never left), re-activating
        the device if the books had retired it."""
        current = self._known(request_id, "relocate")
        if current == device:
            return
        size, charge = self._size[request_id], self._members[current][request_id]
        self._remove(request_id, current)
        if device not in self._members:
            self._activate(device_id=device)
        self._add(request_id, size, device, charge)

    def run_batch(self, ops: Sequence[Op]) -> BatchResult:
        """Departs, then updates, then allocates (the order MELL's batching uses)."""
        placements: dict[str, str] = {}
        moves: list[Move] = []
        self.refused = []
        for kind in (Depart, Update, Allocate):
            for op in ops:
                if type(op) is not kind:
                    continue
                if kind is Depart:
                    self.depart(op.request_id)
                    continue
                if kind is Allocate and self.when_full == "wait":
                    try:
                        res = self.allocate(op.request_id, op.size)
                    except NoCapacity:
                        self.refused.append(op.request_id)
                        self._seq.pop(op.request_id, None)
                        continue
                    placements.update(res.placements)
                    continue
                res = self.update(op.request_id, op.size) if kind is Update else self.allocate(op.request_id, op.size)
                placements.update(res.placements)
                moves.extend(res.moves)
        moves.extend(self._end_of_batch())
        return BatchResult(placements=placements, moves=tuple(moves), moves_before_dedup=len(moves))

    # --- policy hooks --------------------------------------------------------------------
    def _choose(self, charge: int, exclude: str | None) -> str | None:
        raise NotImplementedError

    def _admission_charge(self, request_id: str, size: int) -> int:
        return size

    def _growth_charge(self, request_id: str, size: int, charge: int) -> int:
        return size

    def _relieve(self, device: str, moves: list[Move]) -> None:
        """Overload: the device's engine preempts its newest requests, which wait there (nothing moves)."""

    def _restart_newest(self, device: str, moves: list[Move]) -> None:
        """Overload relieved by restarts: preempt the newest requests and re-place them elsewhere."""
        victims = sorted(self._members[device], key=self._seq.__getitem__, reverse=True)
        for rid in victims:
            if self._load[device] <= self.capacity:
                break
            size, charge = self._size[rid], self._members[device][rid]
            target = self._choose(charge, exclude=device) or self._spare()
            if target is None:  # a fixed pool with no room anywhere: the rest wait where they are
                return
            self._remove(rid, device)
            self._add(rid, size, target, charge)
            moves.append(Move(request_id=rid, source=device, destination=target))

    def _end_of_batch(self) -> list[Move]:
        return []

    # --- helpers -------------------------------------------------------------------------
    def _free(self, device: str) -> int:
        """What a fit decision may use on `device`: capacity less the books' charges and what it holds beyond them."""
        return self.capacity - self._load[device] - self.held.get(device, 0)

    def _add(self, request_id: str, size: int, device: str, charge: int | None = None) -> None:
        charge = size if charge is None else charge
        self._members[device][request_id] = charge
        self._load[device] += charge
        self._bytes[device] += size
        self._size[request_id] = size
        self._loc[request_id] = device

    def _remove(self, request_id: str, device: str) -> None:
        members = self._members[device]
        self._load[device] -= members.pop(request_id)
        self._bytes[device] -= self._size[request_id]
        if not members:  # an idle device is terminated (§VIII-B)
            del self._members[device], self._load[device], self._bytes[device]
            self._order.remove(device)

    def _activate(self, request_id: str = "", size: int = 0, device_id: str | None = None) -> str:
        if device_id is not None:
            device = device_id
        elif self._allowed is None:
            device = f"gpu-{self._minted}"
            self._minted += 1
        else:
            idle = [d for d in self._allowed if d not in self._members]
            if not idle:
                raise NoCapacity(f"{self.name}: request {request_id or '?'} ({size} bytes) fits on no device and all "
                                 f"{len(self._allowed)} devices are active")
            device = idle[0]
        self._members[device] = {}
        self._load[device] = 0
        self._bytes[device] = 0
        self._order.append(device)
        return device

    def _spare(self) -> str | None:
        """A freshly activated device, or None when the device list has none idle."""
        try:
            return self._activate()
        except NoCapacity:
            return None

    def _known(self, request_id: str, op: str) -> str:
        device = self._loc.get(request_id)
        if device is None:
            raise ValueError(f"{op}: unknown request {request_id!r}")
        return device

    def _check_size(self, request_id: str, size: int) -> None:
        if not 0 < size <= self.capacity:
            raise ValueError(f"request {request_id!r}: size {size} must be in (0, capacity={self.capacity}]")
