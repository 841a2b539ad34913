"""The KV-packing fleet's bridge to its placement policy (MellScheduler or a bin-packing baseline): what the
fleet tells the packer before a batch (the bytes copies still hold on devices the books moved requests away
from), and how the packer's answer lands on the fleet (arrivals queued where they were placed, moved requests
marked as not carried out yet, refused arrivals handed back). kv_packing_fleet.py's docstring says why.

It is handed the fleet's per-request tables (shared lists, sets and dicts it updates in place) and a way to
reach a device's queue; it owns only the per-operation counters of `per_op` runs."""
from __future__ import annotations

from bisect import insort
from collections.abc import Callable

from loadgen.sim.kv_packing import apply_op
from loadgen.sim.kv_packing_fleet_state import QUEUED, RUNNING, Device, Flight
from shared.policy.mell_ops import Allocate


class FleetPolicy:
    def __init__(self, policy, name: str, *, ids: list[str], index: dict[str, int], st: list[int],
                 where: list[str | None], size: list[int], frozen: list[int], qsince: list[float],
                 mismatch: set[int], flights: dict[int, Flight], offered: dict[int, tuple[float, int, int]],
                 generated: Callable[[int, float], int], device: Callable[[str], Device], per_op: bool) -> None:
        self.policy, self.name, self.ids, self.index = policy, name, ids, index
        self.st, self.where, self.size, self.frozen, self.qsince = st, where, size, frozen, qsince
        self.mismatch, self.flights, self.offered = mismatch, flights, offered
        self.generated, self.device, self.per_op = generated, device, per_op
        self.max_op = 0 if per_op else -1  # the most moves one operation decided (per_op runs)
        self.max_op_items = 0 if per_op else -1

    def tell_held(self) -> None:
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

    def batch(self, ops: list, arrived: list[int], now: float) -> tuple[int, list[int]]:
        """Run `ops` through the policy: the arrivals it placed wait on their device's queue (their clock
        stops), the requests it moved are marked; returns (moves decided, the arrivals it refused)."""
        policy = self.policy
        if self.per_op:
            placements: dict[str, str] = {}
            moves = []
            for op in ops:
                r = apply_op(policy, op)
                if type(op) is Allocate:
                    placements.update(r.placements)
                self.max_op = max(self.max_op, len(r.moves))
                self.max_op_items = max(self.max_op_items, getattr(policy, "last_op_items", len(r.moves)))
                moves.extend(r.moves)
        else:
            r = policy.run_batch(ops)
            placements, moves = r.placements, r.moves
        refused = set(getattr(policy, "refused", ()))
        turned_away = [i for i in arrived if self.ids[i] in refused] if refused else []
        for i in arrived:
            if refused and self.ids[i] in refused:
                continue
            d = placements.get(self.ids[i]) or policy.device_of(self.ids[i])
            assert d, f"{self.name}: {self.ids[i]} was not placed"
            self.where[i] = d
            first = self.offered.pop(i, None)
            self.frozen[i] = first[2] if first else self.generated(i, now)  # what it holds once admitted (its
            self.st[i] = QUEUED  # clock stops while it waits)
            self.qsince[i] = first[0] if first else now
            insort(self.device(d).queue, i)
        for m in moves:
            i = self.index[m.request_id]
            if self.st[i] in (RUNNING, QUEUED):
                self.mismatch.add(i)
        return len(moves), turned_away

    def movable(self, rid: str) -> bool:
        """Whether the balancer may move request `rid` now (running, no move of it under way or pending)."""
        i = self.index[rid]
        return self.st[i] == RUNNING and i not in self.flights and i not in self.mismatch
