"""MELL as a planner policy: views become Allocate/Depart/Update ops, MELL's placement becomes migrations.

Per model, one packer over the usable workers serving it, with capacity C = the smallest KV capacity
among them × `[planner] kv_high_watermark`, so it never packs a device past the watermark. The packer is
`[planner] packer`: `repackfit` (the default: ours, shared/policy/packer.py, packing as on demand: worst
fit over the workers in use, a new one only when none fits) or `mell` (`MellScheduler`, MELL's classes);
both take the same Allocate/Depart/Update batches and answer `device_of` / `peek_allocate`, so the rest
below is the same for either ("MELL" below: the packer).
Every interval (`decide`):

1. A request seen for the first time (with KV) is *allocated*; one no longer reported *departs*
   (unless a migration of it is in flight or was just applied: the views lag a move); one whose
   KV grew is *updated*. The ops run as one
   batch (`run_batch`, §VI operation batching). A request the dispatcher placed starts where it is:
   where MELL's placement differs from where it runs, that difference is a move.
2. Moves: every request not on its MELL device is a candidate; candidates leaving a worker above the
   watermark come first (KV pressure: they move before requests queue there), then the others
   (fragmentation: consolidation). With a TPOT SLO (`tpot_s` / `tpot_factor`: the live planner passes
   `[slo] tpot`), each goes only where the destination's projected decode step stays within it
   (shared/planner/mell_compute.py: MELL's bins must keep serving at the SLO; on a compute-bound CPU
   worker packing by bytes alone piled every request onto one worker); one that does not waits, and
   `skipped` says why. Then `mell_migration.choose_migration_modes` packs them into the links'
   spare bytes (KV mode) and the destinations' spare prefill tokens (token mode) for this interval,
   honouring `[policies] migration`; what fits neither is tried again next interval.
3. A usable worker with no request, and none on its way to it, is reported idle (once per idle spell).

`placement_hints(view)` (after `decide`): per model, the worker MELL would allocate a new request of
each size class to now (`mell_hints`), for the dispatcher's `mell` routing and the simulator.

When the set of workers changes (or their KV capacity, by more than CAPACITY_DRIFT), the model's
scheduler is rebuilt from the requests as they are. A request whose migration failed `max_attempts`
times is left where it runs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from shared.events.plan import Migrate, PlacementHints, PlanApplied, PlanFailed, PlanOutcome, ReportIdle
from shared.planner.effects import Decision, Effect, action_of
from shared.planner.mell_compute import ComputeGate, TpotSlo
from shared.planner.mell_hints import HINT_INTERVALS, model_hints
from shared.planner.policy import Busy
from shared.planner.view import ClusterView, WorkerView
from shared.policy.mell import Allocate, Depart, MellScheduler, Update
from shared.policy.mell_migration import MigrationCandidate, choose_migration_modes
from shared.policy.mell_ops import NoCapacity
from shared.policy.packer import RepackFit

MigrationSetting = Literal["auto", "kv", "tokens", "off"]
PackerSetting = Literal["repackfit", "mell"]
CAPACITY_DRIFT = 0.25  # a model's scheduler is rebuilt when its devices' KV capacity changes by more than this
# A request just migrated is missing from the views for a moment (its destination's stats predate the commit):
# it does not depart while it is this young a move (the larger of these intervals and seconds).
MOVE_GRACE_INTERVALS, MOVE_GRACE_S = 3, 1.0
# A request that moved without this planner's plan (an operator's or an external scheduler's MigrateOut, a
# re-dispatch) stays where it went this long: the planner does not undo a move it did not make.
OPERATOR_HOLD_S = 60.0


@dataclass
class _ModelState:
    scheduler: MellScheduler | RepackFit
    devices: tuple[str, ...]
    capacity: int
    sizes: dict[str, int] = field(default_factory=dict)  # requests MELL holds -> the size it knows


class MellPolicy:
    name = "mell"

    def __init__(self, *, migration: MigrationSetting = "auto", kv_high_watermark: float = 0.9,
                 max_migrations_per_op: int = 10, max_attempts: int = 3, batching: bool = True,
                 operator_hold_s: float = OPERATOR_HOLD_S, packer: PackerSetting = "mell",
                 tpot_s: float | None = None, tpot_factor: float | None = None, consolidate: bool = True) -> None:
        if not 0 < kv_high_watermark <= 1:
            raise ValueError(f"kv_high_watermark must be in (0, 1], got {kv_high_watermark}")
        if migration not in ("auto", "kv", "tokens", "off"):
            raise ValueError(f"migration must be auto, kv, tokens or off, got {migration!r}")
        if packer not in ("repackfit", "mell"):
            raise ValueError(f"packer must be repackfit or mell, got {packer!r}")
        self.packer = packer
        self.migration = migration
        self.consolidate = consolidate  # False: only KV-pressure moves (a load-spreading router places requests)
        self.kv_high_watermark = kv_high_watermark
        self.max_migrations_per_op = max_migrations_per_op
        self.max_attempts = max_attempts
        self.batching = batching
        self.models: dict[str, _ModelState] = {}
        self.failures: Counter[str] = Counter()  # request -> failed migrations
        self.reported_idle: set[str] = set()
        self.unplaced: set[str] = set()  # requests MELL found no room for (NoCapacity): left where they run
        self.moved_at: dict[str, float] = {}  # request -> when its last migration was applied
        self.operator_hold_s = operator_hold_s
        self.seen_on: dict[str, str] = {}  # request -> the worker it ran on at the last interval
        self.planned_to: dict[str, str] = {}  # request -> the destination of this planner's applied move
        self.held_until: dict[str, float] = {}  # request moved by someone else -> not moved before this time
        # the compute boundary: no SLO given (both None), no gate (MELL's own packing, as the simulator runs it)
        no_slo = tpot_s is None and tpot_factor is None
        self.gate = None if no_slo else ComputeGate(TpotSlo(tpot_s=tpot_s, factor=tpot_factor))
        self.en_route: dict[str, tuple[str, str]] = {}  # request -> (destination, model) of this policy's move
        self.skipped: dict[str, str] = {}  # request -> why its move waits (the last interval's, by the gate)
        self.skips: Counter[str] = Counter()  # moves the gate held back, by trigger (all intervals)
        self._notes: dict[str, str] = {}  # request -> the projection its move was admitted on (this interval)

    # --- the Policy protocol ----------------------------------------------------------------
    def decide(self, view: ClusterView, busy: Busy) -> list[Decision]:
        pressure: list[tuple[MigrationCandidate, str]] = []
        other: list[tuple[MigrationCandidate, str]] = []
        targets: set[str] = set()
        if self.gate is not None:
            self.gate.observe(view)
            for rid, (dest, _) in list(self.en_route.items()):
                where = view.location(rid)
                # arrived (its destination's stats count it now), or no longer on its way (neither in flight nor
                # an applied move still missing from the views)
                if (where is not None and where[0] == dest) or not (busy.request(rid) or rid in self.moved_at):
                    del self.en_route[rid]
        for model, workers in sorted(_serving(view).items()):
            state = self._state_for(model, workers)
            self._sync(state, view, model, busy)
            self._note_moves_by_others(state, view, busy)
            for rid, (source, destination) in self._moves(state, view, busy).items():
                targets.add(destination)
                req = view.request(rid)
                if req is None:
                    continue
                candidate = MigrationCandidate(request_id=rid, source=source, destination=destination,
                                               kv_bytes=req.kv_bytes, tokens=req.tokens)
                hot = view.workers[source].kv_usage > self.kv_high_watermark
                if hot:
                    pressure.append((candidate, model))
                elif self.consolidate:
                    other.append((candidate, model))
        decisions = self._migrations(view, pressure, other)
        decisions += self._idle(view, targets)
        return decisions

    def on_outcome(self, effect: Effect, outcome: PlanOutcome) -> None:
        action = action_of(effect)
        if isinstance(action, Migrate):
            if isinstance(outcome, PlanApplied):
                self.failures.pop(action.request_id, None)
                self.moved_at[action.request_id] = outcome.ts
                self.planned_to[action.request_id] = action.destination
            else:
                self.en_route.pop(action.request_id, None)  # it did not go: not on its way to the destination
            if isinstance(outcome, PlanFailed):  # a stale view's cancellation is not the request's failure
                self.failures[action.request_id] += 1
        elif isinstance(action, ReportIdle) and not isinstance(outcome, PlanApplied):
            self.reported_idle.discard(action.worker_id)  # not reported after all: report it again

    def placement_hints(self, view: ClusterView) -> list[PlacementHints]:
        """Where MELL would allocate new requests of each model now, by KV size class. A model whose
        scheduler does not match the view's workers (not decided on yet, or the workers changed) gets
        none: the dispatcher routes it by load until the next interval."""
        out = []
        for model, workers in sorted(_serving(view).items()):
            state = self.models.get(model)
            if state is None or state.devices != tuple(w.worker_id for w in workers):
                continue
            out.append(model_hints(model, state.scheduler, view.now, HINT_INTERVALS * view.interval_s))
        return out

    # --- MELL's model of the cluster --------------------------------------------------------
    def _state_for(self, model: str, workers: list[WorkerView]) -> _ModelState:
        devices = tuple(w.worker_id for w in workers)
        kv = min(inst.kv_capacity_bytes for w in workers if (inst := w.instance_of(model)) is not None)
        capacity = max(8, int(kv * self.kv_high_watermark))
        state = self.models.get(model)
        # a pool's KV block count drifts (adapters, workspace): only a real change of capacity rebuilds
        drifted = state is not None and abs(state.capacity - capacity) > CAPACITY_DRIFT * state.capacity
        if state is None or state.devices != devices or drifted:
            scheduler: MellScheduler | RepackFit
            if self.packer == "repackfit":  # packed as on demand (no spreading over idle workers: they are released)
                scheduler = RepackFit(capacity, list(devices), spread=False)
            else:
                scheduler = MellScheduler(capacity, list(devices), max_migrations_per_op=self.max_migrations_per_op,
                                          batching=self.batching)
            state = self.models[model] = _ModelState(scheduler, devices, capacity)
        return state

    def _sync(self, state: _ModelState, view: ClusterView, model: str, busy: Busy) -> None:
        """Allocate the new requests, depart the gone ones, update the grown ones: one batch."""
        present: dict[str, int] = {}
        for device in state.devices:
            inst = view.workers[device].instance_of(model)
            for req in inst.requests if inst is not None else ():
                if req.kv_bytes > 0:
                    present[req.request_id] = min(req.kv_bytes, state.capacity)
        ops: list[Allocate | Depart | Update] = []
        before = dict(state.sizes)
        grace = max(MOVE_GRACE_INTERVALS * view.interval_s, MOVE_GRACE_S)
        for rid in [r for r, at in self.moved_at.items() if r in present or view.now - at >= grace]:
            del self.moved_at[rid]  # seen where it went, or gone for good
        for rid in list(state.sizes):
            if rid not in present and not busy.request(rid) and rid not in self.moved_at:
                ops.append(Depart(rid))
                del state.sizes[rid]
        for rid, size in sorted(present.items(), key=_by_location(view)):
            known = state.sizes.get(rid)
            if known is None and rid not in self.unplaced:
                ops.append(Allocate(rid, size))
                state.sizes[rid] = size
            elif known is not None and size > known:
                ops.append(Update(rid, size))
                state.sizes[rid] = size
        self.unplaced &= set(present)
        if not ops:
            return
        try:
            state.scheduler.run_batch(ops)
        except (NoCapacity, KeyError, ValueError):
            # the batch did not go through as a whole (it fit nowhere, or MELL's state and ours disagree):
            # apply it op by op, each only where it still applies, leaving out what fits nowhere
            self._one_by_one(state, ops, before)
        # what we believe MELL holds is what it holds: a request it does not hold is allocated afresh
        for rid in [r for r in state.sizes if state.scheduler.device_of(r) is None]:
            del state.sizes[rid]

    def _one_by_one(self, state: _ModelState, ops: Iterable[Allocate | Depart | Update],
                    before: dict[str, int]) -> None:
        for op in ops:
            try:
                if isinstance(op, Depart):
                    if state.scheduler.device_of(op.request_id) is not None:
                        state.scheduler.depart(op.request_id)
                elif isinstance(op, Update):
                    if state.scheduler.device_of(op.request_id) is not None:
                        state.scheduler.update(op.request_id, op.size)
                elif state.scheduler.device_of(op.request_id) is None:
                    state.scheduler.allocate(op.request_id, op.size)
            except NoCapacity:
                if isinstance(op, Update) and op.request_id in before:
                    state.sizes[op.request_id] = before[op.request_id]  # MELL keeps it at its old size
                else:
                    state.sizes.pop(op.request_id, None)
                    self.unplaced.add(op.request_id)

    def _moves(self, state: _ModelState, view: ClusterView, busy: Busy) -> dict[str, tuple[str, str]]:
        """request -> (where it runs, where MELL has it), for every request not where MELL wants it."""
        out: dict[str, tuple[str, str]] = {}
        for rid in sorted(state.sizes):
            target, where = state.scheduler.device_of(rid), view.location(rid)
            if target is None or where is None or where[0] == target or busy.request(rid):
                continue
            if self.failures[rid] >= self.max_attempts or self.held_until.get(rid, 0.0) > view.now:
                continue
            out[rid] = (where[0], target)
        return out

    def _note_moves_by_others(self, state: _ModelState, view: ClusterView, busy: Busy) -> None:
        """A request now on another worker than last interval, which this planner did not send there, was
        moved by someone else: hold it there for `operator_hold_s` (MELL would otherwise move it back)."""
        for rid in state.sizes:
            where = view.location(rid)
            if where is None:
                continue
            before, self.seen_on[rid] = self.seen_on.get(rid), where[0]
            if before is None or before == where[0] or busy.request(rid):
                continue
            if self.planned_to.pop(rid, None) == where[0]:
                continue  # our own move, arrived
            self.held_until[rid] = view.now + self.operator_hold_s
        gone = [r for r in self.seen_on if r not in state.sizes and view.location(r) is None]
        for rid in gone:
            self.seen_on.pop(rid, None)
            self.planned_to.pop(rid, None)
        for rid in [r for r, until in self.held_until.items() if until <= view.now or r in gone]:
            del self.held_until[rid]

    # --- decisions ------------------------------------------------------------------------
    def _migrations(self, view: ClusterView, pressure: list[tuple[MigrationCandidate, str]],
                    other: list[tuple[MigrationCandidate, str]]) -> list[Decision]:
        ordered = self._compute_gate(view, pressure, other)
        if not ordered:
            return []
        candidates = [c for c, _ in ordered]
        links = {(c.source, c.destination): view.link_budget(c.source, c.destination) for c in candidates}
        prefill: dict[str, float] = {}
        for c, m in ordered:  # one budget per destination (shared by its moves); under "auto" paced by what the
            # destination measured it prefills (a slow one takes the move as KV); a forced "tokens" keeps the budget
            prefill.setdefault(c.destination, view.prefill_budget(c.destination, m if self.migration == "auto" else None))
        model_of = {c.request_id: m for c, m in ordered}
        hot = {c.request_id for c, _ in pressure}
        notes = self._notes
        decisions = []
        for choice in choose_migration_modes(candidates, links, prefill, self.migration):
            if choice.mode == "defer":
                continue
            inst = view.workers[choice.destination].instance_of(model_of[choice.request_id])
            if inst is None:
                continue
            trigger = "kv_pressure" if choice.request_id in hot else "fragmentation"
            why = (f"{choice.source} is above the KV high watermark" if trigger == "kv_pressure"
                   else f"MELL consolidates onto {choice.destination}")
            if choice.request_id in notes:
                why += f"; {notes[choice.request_id]}"
                self.en_route[choice.request_id] = (choice.destination, model_of[choice.request_id])
            decisions.append(Decision(
                action=Migrate(request_id=choice.request_id, source=choice.source, destination=choice.destination,
                               destination_instance=inst.instance_id, mode=choice.mode),
                trigger=trigger, reason=f"{why}; by {choice.mode}",
            ))
        return decisions

    def _compute_gate(self, view: ClusterView, pressure: list[tuple[MigrationCandidate, str]],
                      other: list[tuple[MigrationCandidate, str]]) -> list[tuple[MigrationCandidate, str]]:
        """The moves whose destinations keep decoding within the TPOT SLO (all of them without a gate), in
        order; `_notes` the projection each was admitted on, `skipped` why the others wait."""
        self._notes, self.skipped = {}, {}
        if self.gate is None:
            return pressure + other
        arriving = Counter(self.en_route.values())
        moves = [(c, m, True) for c, m in pressure] + [(c, m, False) for c, m in other]
        admitted = []
        for verdict in self.gate.judge(view, moves, arriving):
            rid = verdict.candidate.request_id
            if verdict.ok:
                self._notes[rid] = verdict.note
                admitted.append((verdict.candidate, verdict.model))
            else:
                self.skipped[rid] = verdict.note
                self.skips["kv_pressure" if verdict.hot else "fragmentation"] += 1
        return admitted

    def _idle(self, view: ClusterView, targets: set[str]) -> list[Decision]:
        decisions = []
        for worker in view.usable_workers():
            if worker.requests or worker.worker_id in targets:
                self.reported_idle.discard(worker.worker_id)
                continue
            if worker.worker_id in self.reported_idle:
                continue
            self.reported_idle.add(worker.worker_id)
            decisions.append(Decision(action=ReportIdle(worker_id=worker.worker_id, since_ts=view.now),
                                      trigger="idle", reason=f"{worker.worker_id} holds no request"))
        return decisions


def _serving(view: ClusterView) -> dict[str, list[WorkerView]]:
    """model -> the usable workers with an instance of it (in worker id order)."""
    out: dict[str, list[WorkerView]] = {}
    for worker in view.usable_workers():
        for inst in worker.instances:
            if inst.kv_capacity_bytes > 0:
                out.setdefault(inst.model, []).append(worker)
    return out


def _by_location(view: ClusterView):  # type: ignore[no-untyped-def]
    """Allocation order: by the worker a request runs on, then its id (deterministic)."""
    def order(item: tuple[str, int]) -> tuple[str, str]:
        where = view.location(item[0])
        return (where[0] if where else "", item[0])
    return order


__all__ = ["MellPolicy"]
