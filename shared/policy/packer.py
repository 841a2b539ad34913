"""Tidal's own KV packer (beyond MELL): greedy fit that keeps Eq. 2 and a worst-case bound.

Why: MELL's class-based packing (4/3 OPT + c) loses to plain greedy fit when nearly every request's
KV is under C/8 (tiny requests bundled into multi-items cost T-GPU slack and moves), and greedy fit
alone (the BF/WF baselines) keeps no Eq. 2 (requests wait or restart when they outgrow a device) and
no bound once requests leave. `RepackFit` takes greedy fit's packing and adds what those lack:

- Allocate: worst fit on the KV the request holds now (the active device with the most free memory
  that fits it, memory a copy still holds left alone: headroom for growth); a new device only when none
  fits and no room can be made by moving at most `room_moves` requests (best fit each) off the freest
  devices. On a fixed device list (a pool, `spread`), an idle GPU of the pool counts as the freest:
  arrivals spread over every GPU that is paid for anyway.
- Update (growth): when a device's requests outgrow it, requests move off after the batch's arrivals
  are placed (an arrival that waits costs its TTFT; a request that waits to grow, a few tokens) -- the
  smallest whose move ends the overflow, else the largest, again while it overflows -- to the freest
  device with room, or where room is made, or to a device it opens (Eq. 2: every request's KV stays
  resident). The repro carries its moves by tokens (a re-prefill on the destination, no copy holding
  memory on both sides).
- Balancing (`balance=True`, as `tidal repro mell` runs ours): after each batch, Llumnix's round
  (binpack_lb.LoadBalance.balance, via LoadBalanceOpen): a device under `migrate_out_free` bytes free per
  request sheds its shortest request to the freest device when that does not reverse the pair. On a
  tight pool this keeps room on every GPU for its requests' growth (fewer preemptions, whose waits
  cost the TPOT target) and spreads the free memory arrivals need. It moves between active devices
  only: it never opens one (on demand no overflow is left after the batch for LoadBalanceOpen's
  opening step), so the bound below is untouched (tested with and without it).
- Consolidation, only when a device would be opened (an arrival or a moved request fits on no active
  device): while the least-loaded device's requests fit, together, into another device (best fit),
  they move there and it retires; then a device is opened if still needed. Consolidating only then
  keeps the moves few (a merge moves all of a device's requests) and is all the bound needs.

Worst-case bound (Eq. 3's objective is the peak): a device is opened only when the least-loaded one
fits into no other, i.e. when every two active devices hold more than C together, so n <= 2 * L1
(L1 = ceil(S / C), S the KV in use) before it and n <= 2 * L1 + 1 after; between openings n does
not grow. Hence peak n <= 2 * max_t OPT(t) + 1 (held copies aside). Weaker than MELL's
4/3 OPT + 5/3 on adversarial inputs; checked by hypothesis against exact optima
(tests/policy/test_packer.py, balancing on and off); on the paper's workloads the repro measures both. Moves per operation
are not capped: an overflow moves what it must, a consolidation one device's requests per merge.
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.binpack_baselines import best_fit
from shared.policy.binpack_lb import LoadBalanceOpen, worst_fit
from shared.policy.mell_ops import Move, NoCapacity, OpResult

__all__ = ["RepackFit"]


class RepackFit(LoadBalanceOpen):
    name = "Ours"
    migrates = True  # moves are live KV migrations (the fleet may carry them as tokens: MELL §V's choice)

    def __init__(self, capacity: int, devices: Sequence[str] | None = None, *, consolidate: bool = True,
                 fit: str = "worst", merge_fill: float = 1.0, room_moves: int = 2, balance: bool = False,
                 migrate_out_free: int = 0, spread: bool = True) -> None:
        super().__init__(capacity, devices, migrate_out_free=migrate_out_free)
        if not balance:
            self.balance = None  # type: ignore[assignment]  # no periodic balancing round (the fleet skips it)
        if fit not in ("best", "worst"):
            raise ValueError(f"fit must be best or worst, got {fit!r}")
        if not 0.5 <= merge_fill <= 1.0:
            raise ValueError(f"merge_fill must be in [0.5, 1], got {merge_fill}")
        self.consolidate = consolidate
        self.fit = fit
        self.merge_fill = merge_fill  # consolidate two devices when together they fill at most this share of C
        self.merges = 0  # devices emptied by consolidation
        self.spread = spread  # on a fixed device list, worst fit counts its idle GPUs (spread over the pool)
        self._overflow: set[str] = set()  # devices whose requests outgrew them in this batch
        self.room_moves = room_moves  # requests one make-room may move (0: never make room, open or wait)

    def _choose(self, charge: int, exclude: str | None) -> str | None:
        if self.spread and self._allowed is not None and self.fit == "worst":  # a fixed pool: an idle GPU is the
            idle = next((d for d in self._allowed if d not in self._members), None)  # freest of all
            if idle is not None and charge <= self.capacity - self.held.get(idle, 0):
                return self._activate(device_id=idle)
        return best_fit(self, charge, exclude) if self.fit == "best" else worst_fit(self, charge, exclude)

    def peek_allocate(self, size: int) -> str | None:
        """The device `allocate` would choose for a request of `size` now if it fits somewhere as things are,
        changing nothing (the planner's placement hints); with a device list, the first idle one when none
        fits (what `allocate` would open after making room or consolidating is not foreseen); None when
        nothing is idle or the devices are minted on demand."""
        self._check_size("peeked", size)
        if self.spread and self._allowed is not None and self.fit == "worst":
            idle = next((d for d in self._allowed if d not in self._members), None)
            if idle is not None and size <= self.capacity - self.held.get(idle, 0):
                return idle
        chosen = best_fit(self, size, None) if self.fit == "best" else worst_fit(self, size, None)
        if chosen is not None or self._allowed is None:
            return chosen
        return next((d for d in self._allowed if d not in self._members), None)

    def allocate(self, request_id: str, size: int) -> OpResult:
        if request_id in self._loc:
            raise ValueError(f"allocate: request {request_id!r} is already placed on {self._loc[request_id]}")
        self._check_size(request_id, size)
        moves: list[Move] = []
        device = self._choose(size, None) or self._make_room(size, None, moves) or self._open(moves, request_id, size)
        self._seq[request_id] = self._arrivals
        self._arrivals += 1
        self._add(request_id, size, device, size)
        return OpResult(placements={request_id: device}, moves=tuple(moves))

    def _open(self, moves: list[Move], request_id: str = "", size: int = 0) -> str:
        """A device for what fits on no active one: consolidate first (the bound), then activate one
        (NoCapacity when a fixed pool has none left)."""
        self._consolidate(moves)
        return self._choose(size, None) or self._activate(request_id, size)

    def _relieve(self, device: str, moves: list[Move]) -> None:
        """An overflowing device is relieved at the end of the batch, after its arrivals are placed (they
        take the free memory first: a request that waits for its first token costs its TTFT, one that
        waits for memory to grow costs a few of its tokens)."""
        self._overflow.add(device)

    def _end_of_batch(self) -> list[Move]:
        moves: list[Move] = []
        for device in sorted(self._overflow, key=self._order.index) if self._overflow else ():
            if device in self._members:
                self._relieve_now(device, moves)
        self._overflow.clear()
        return moves

    def _relieve_now(self, device: str, moves: list[Move]) -> None:
        """Move requests off an overflowing device (the smallest that ends the overflow, else the largest)."""
        while device in self._members and self._load[device] > self.capacity:
            over = self._load[device] - self.capacity
            cands = [(c, self._seq[rid], rid) for rid, c in self._members[device].items()]
            enough = [x for x in cands if x[0] >= over]
            charge, _, rid = min(enough) if enough else max(cands)
            target = self._choose(charge, exclude=device) or self._make_room(charge, device, moves)
            if target is None:
                try:
                    target = self._open(moves, rid, charge)
                except NoCapacity:  # a fixed pool with no room anywhere: the device's engine preempts
                    return
                if target == device:
                    continue
            size = self._size[rid]
            self._remove(rid, device)
            self._add(rid, size, target, charge)
            moves.append(Move(request_id=rid, source=device, destination=target))

    def _make_room(self, charge: int, exclude: str | None, moves: list[Move]) -> str | None:
        """Room for `charge` on an active device by moving at most `room_moves` of its requests to others
        (best fit each), the freest devices tried first; None when no such plan exists (nothing moves)."""
        if not self.room_moves:
            return None
        order = sorted((d for d in self._order if d != exclude), key=lambda d: (-self._free(d), d))
        for d in order[:3]:
            need = charge - self._free(d)
            if need <= 0:
                return d
            members = sorted(self._members[d].items(), key=lambda x: (x[1], self._seq[x[0]]))
            enough = [x for x in members if x[1] >= need]
            plan = [enough[0]] if enough else []
            if not plan:
                freed = 0
                for x in reversed(members):
                    plan.append(x)
                    freed += x[1]
                    if freed >= need or len(plan) > self.room_moves:
                        break
                if freed < need:
                    continue
            if len(plan) > self.room_moves or len(plan) == len(members):  # emptying d would retire it: that is
                continue  # an opening, not room made
            extra: dict[str, int] = {}
            dests = []
            for rid, c in plan:
                fits = [(self._free(t) - extra.get(t, 0), t) for t in self._order
                        if t not in (d, exclude) and self._free(t) - extra.get(t, 0) >= c]
                if not fits:
                    break
                t = min(fits)[1]
                extra[t] = extra.get(t, 0) + c
                dests.append(t)
            if len(dests) < len(plan):
                continue
            for (rid, c), t in zip(plan, dests):
                size = self._size[rid]
                self._remove(rid, d)
                self._add(rid, size, t, c)
                moves.append(Move(request_id=rid, source=d, destination=t))
            return d
        return None

    def _consolidate(self, moves: list[Move]) -> None:
        """While the least-loaded device's requests fit together into another (best fit, keeping
        1 - merge_fill of C free there), they move there and it retires."""
        if not self.consolidate:
            return
        while len(self._order) > 1:
            rank = {d: i for i, d in enumerate(self._order)}
            src = min(self._order, key=lambda d: (self._load[d] + self.held.get(d, 0), -rank[d]))
            if self.held.get(src, 0) or self._load[src] > self.capacity:
                return
            slack = self.capacity - int(self.merge_fill * self.capacity)  # what the merged device keeps free
            dst = best_fit(self, self._load[src] + slack, src)
            if dst is None:
                return
            for rid in sorted(self._members[src], key=self._seq.__getitem__):
                size, charge = self._size[rid], self._members[src][rid]
                self._remove(rid, src)
                self._add(rid, size, dst, charge)
                moves.append(Move(request_id=rid, source=src, destination=dst))
            self.merges += 1
