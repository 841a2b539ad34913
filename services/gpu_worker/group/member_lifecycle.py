"""A buddy-group member's life beyond the pipeline: restore, solo, leaving, collapse (KunServe §4.3).

* `restore_layers` loads dropped layers back as free KV blocks give the bytes; the member then
  migrates its requests back (`migrate_back.py`) and goes `solo`: its own requests run on every
  layer here while it still runs its stage for the other owners.
* `leave` ends the membership once nothing would be lost (`leave_blocker`).
* `collapse` (a member is gone): run alone at once, own requests recomputed token-exact.

Mixed into `member.GroupMember`; engine thread only. No I/O.
"""
from __future__ import annotations

from typing import Any

from .migrate_back import MigrateBack


class MemberLifecycle:
    # state of `member.GroupMember`, which this class is part of
    engine: Any
    member_id: str
    executor: Any
    in_flight: dict
    victims: dict[str, int]
    solo: bool
    restore_requested: bool
    back: MigrateBack

    def restore_layers(self, start: int, end: int) -> bool:
        """Load dropped layers of [start, end) back, one at a time as far as free KV blocks give the
        bytes (live KV is never evicted for it); True once all are back. Then the requests migrate
        back (`migrate_back`)."""
        self.restore_requested = True
        held = self.engine.runner.resident_layers()
        todo = sorted((l for l in range(start, end) if l not in held), reverse=bool(held) and end <= held[0])
        for layer in todo:  # next to the resident range first: it stays contiguous
            try:
                self.engine.restore_layers(layer, layer + 1)
            except MemoryError:
                return False
        return True

    @property
    def restored(self) -> bool:
        runner = self.engine.runner
        return len(runner.resident_layers()) == runner.cfg.num_layers

    def foreign(self) -> list[str]:
        """Other owners' sequences whose KV of this stage is still here."""
        return [s for s in self.executor.held if self.engine.blocks.has(s) and self.engine.scheduler.get(s) is None]

    def leave_blocker(self) -> str | None:
        """Why leaving now would lose KV, or None: nothing in flight, no exchange, no other owner's KV
        here, and this member's own requests (if any) all local (solo, after the migrate-back)."""
        if self.in_flight or self._exchange or self._awaiting:
            return "micro-batches or a KV exchange are in flight"
        if not self.solo and self.engine.has_unfinished:
            return "its requests still run through the pipeline (restore the layers: they migrate back)"
        foreign = self.foreign()
        if foreign:
            return f"it holds other members' KV of {len(foreign)} requests (they migrate back first)"
        return None

    def go_solo(self) -> None:
        """Every own request's KV is here now: run them on every layer; keep serving the stage."""
        everything = range(self.engine.runner.cfg.num_layers)
        self.engine.blocks.set_layers(everything, keep_tables=True)
        self.engine.runner.set_kv_layers(everything)
        self.executor.stage_only = True
        self.victims.clear()
        self.solo = True

    def collapse(self) -> None:
        """A member is gone: the pipeline cannot run. Run alone on every layer (restored from the
        host copy), own requests recomputed (token-exact), the other owners' KV freed."""
        sched = self.engine.scheduler
        self.in_flight.clear()
        self._in_flight_ids.clear()
        self._preempt_later.clear()
        for seq in list(sched.running):
            self.preempt(seq.seq_id)
        for seq_id in list(self.executor.held):
            if sched.get(seq_id) is None:
                self.executor.free(seq_id)
        self._exchange, self._awaiting, self.victims, self._freed = [], {}, {}, []
        self.back = MigrateBack(self)
        runner = self.engine.runner
        missing = [l for l in range(runner.cfg.num_layers) if l not in runner.resident_layers()]
        if missing:
            self.engine.restore_layers(missing[0], missing[-1] + 1, preempt=True)
        self.solo = True
        self.leave()

    def leave(self) -> None:
        """Leave the group, holding every layer again (restored first by the caller). Only when
        nothing of the group remains here (`leave_blocker`)."""
        runner = self.engine.runner
        blocker = self.leave_blocker()
        if blocker:
            raise RuntimeError(f"{self.member_id} still serves the group: {blocker}")
        missing = [l for l in range(runner.cfg.num_layers) if l not in runner.resident_layers()]
        if missing:
            raise RuntimeError(f"{self.member_id} must restore layers {missing} before leaving")
        everything = range(runner.cfg.num_layers)
        self.engine.blocks.set_layers(everything, keep_tables=True)
        runner.set_kv_layers(everything)
        self.executor.stage_only = self.solo = False
        self.group_id, self.stages = None, []
