"""MELL in the KV-packing simulation through the planner core, as the live cluster runs it.

`kv_packing.run_policy` calls MellScheduler directly: a request starts wherever MELL's Allocate puts
it. Live, the dispatcher places new requests and the planner (PlannerCore + MellPolicy) only sees
them afterwards, in its next view. `run_core` replays the same op stream that way:

* a fixed set of simulated devices (ids in list order, as MELL activates them), each holding
  requests with their KV bytes;
* each epoch, departures leave and grown requests grow where they are; arrivals are routed by the
  dispatcher's `mell` routing (shared/policy/routing_mell.py) from the latest placement hints,
  falling back to least load;
* the simulator builds a ClusterView of its devices and calls `core.step(view)`; each Migrate is
  booked at once and reported back with PlanApplied; ReportIdle needs nothing. With a MoveModel,
  each move pays what kv_packing_moves.py charges every policy (pre-copy over the kv link, the
  source held until the hand-over, a stall, failures retried; tokens mode: a re-prefill);
* `core.placement_hints(view)` gives the hints for the next epoch's arrivals.

The GPU count of an epoch is the devices holding a request after its effects. No clock reads in the
loop but the wall time of the whole run.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadgen.sim.kv_packing import PackingResult, Schedule
from loadgen.sim.kv_packing_moves import MoveLedger, MoveModel, request_end_times
from shared.events.plan import Migrate, PlanApplied
from shared.planner import ClusterView, InstanceView, PlannerCore, RequestView, WorkerView
from shared.planner.mell_policy import MellPolicy
from shared.policy.admission import with_room
from shared.policy.mell_ops import Allocate, Depart, Update
from shared.policy.routing import InstanceView as RouteInstance
from shared.policy.routing import RequestView as RouteRequest
from shared.policy.routing_mell import MellRouting

MODEL = "m"
UNLIMITED = 1e18  # link bytes per interval: the paper's simulator does not limit migration bandwidth


@dataclass(frozen=True)
class CorePackingResult(PackingResult):
    routes: dict[str, int] = field(default_factory=dict)  # MellRouting outcomes: hinted, or why it fell back
    misroutes: int = 0  # migrations of requests in their first epoch: routed elsewhere than MELL allocated them
    devices: int = 0  # simulated devices


def device_count(schedule: Schedule) -> int:
    """Enough devices that MELL never runs out: its active count is at most 4/3 W(I) + c and W(I) at most
    twice the KV in use over C (L-requests just above C/2 weigh 1 each), capped by the most requests
    ever live at once (one per device)."""
    live = peak = 0
    for ops in schedule.epochs:
        live += sum(1 for op in ops if type(op) is Allocate) - sum(1 for op in ops if type(op) is Depart)
        peak = max(peak, live)
    bound = math.ceil(3 * int(schedule.used_bytes.max(initial=0)) / schedule.capacity) + 16
    return max(1, min(peak + 1, bound))


class SimCluster:
    """Simulated devices: request -> KV bytes per device, and the views the planner and router read."""

    def __init__(self, n: int, capacity: int, bytes_per_token: int) -> None:
        self.ids = [f"gpu-{i:04d}" for i in range(n)]
        self.capacity = capacity
        self.bpt = bytes_per_token
        self.held: dict[str, dict[str, int]] = {d: {} for d in self.ids}
        self.used: dict[str, int] = dict.fromkeys(self.ids, 0)
        self.where: dict[str, str] = {}
        self._cached: dict[str, WorkerView] = {}  # device -> its view, while unchanged

    def put(self, rid: str, device: str, size: int) -> None:
        self.held[device][rid] = size
        self.used[device] += size
        self.where[rid] = device
        self._cached.pop(device, None)

    def take(self, rid: str) -> tuple[str, int]:
        device = self.where.pop(rid)
        size = self.held[device].pop(rid)
        self.used[device] -= size
        self._cached.pop(device, None)
        return device, size

    def active(self) -> int:
        return sum(1 for d in self.ids if self.held[d])

    def route_views(self) -> list[RouteInstance]:
        cap_tok = self.capacity // self.bpt
        return [RouteInstance(instance_id=d, worker_id=d, model=MODEL, kv_blocks_total=cap_tok, block_size=1,
                              kv_blocks_used=self.used[d] // self.bpt, running_requests=len(self.held[d]),
                              max_batch=1 << 30, kv_block_bytes=self.bpt) for d in self.ids]

    def view(self, now: float, interval_s: float, link_budget_bytes: float = UNLIMITED,
             prefill_budget_tokens: float = 0.0) -> ClusterView:
        workers = {}
        for d in self.ids:
            w = self._cached.get(d)
            if w is None:
                reqs = tuple(RequestView(rid, prompt_tokens=size // self.bpt, tokens=size // self.bpt,
                                         kv_tokens=size // self.bpt, kv_bytes=size, projected_kv_bytes=size)
                             for rid, size in self.held[d].items())
                # one byte per block: MELL's capacity is exactly the device's KV bytes, as on the direct path
                inst = InstanceView(instance_id=d, model=MODEL, worker_id=d, running=len(reqs),
                                    kv_blocks_total=self.capacity, kv_blocks_used=self.used[d], kv_block_bytes=1,
                                    requests=reqs)
                w = self._cached[d] = WorkerView(worker_id=d, instances=(inst,))
            workers[d] = w
        return ClusterView(now=now, interval_s=interval_s, workers=workers, default_link_budget_bytes=link_budget_bytes,
                           default_prefill_budget_tokens=prefill_budget_tokens)


def run_core(schedule: Schedule, name: str = "MELL", *, max_migrations_per_op: int = 10, batching: bool = True,
             devices: int | None = None, hints: bool = True, check: bool = True,
             moves: MoveModel | None = None, migration: str = "kv", link_budget_bytes: float = UNLIMITED,
             prefill_budget_tokens: float = 0.0) -> CorePackingResult:
    """Replay `schedule` with MELL in PlannerCore and arrivals routed by its placement hints
    (`hints=False`: by least load only, as a dispatcher without `mell` routing). `moves`: what each
    move costs (None: instant). `migration` ("kv", "tokens", "auto": MellPolicy's setting) with the
    view's budgets per interval: each link's bytes and each destination's prefill tokens (MELL §V)."""
    started = time.perf_counter()
    ledger = None
    if moves is not None:
        if schedule.end_s is None:
            raise ValueError(f"{name}: charging moves needs the schedule's request end times")
        ledger = MoveLedger(moves, schedule.capacity, request_end_times(schedule.end_s))
    sim = SimCluster(devices or device_count(schedule), schedule.capacity, schedule.bytes_per_token)
    core = PlannerCore([MellPolicy(migration=migration, kv_high_watermark=1.0,  # type: ignore[arg-type]
                                   max_migrations_per_op=max_migrations_per_op, batching=batching)], id_prefix="sim")
    router = MellRouting()
    active = np.zeros(len(schedule.epochs), np.int64)
    n_moves = misroutes = overcommitted = 0
    epoch_s = schedule.epoch_s
    for e, ops in enumerate(schedule.epochs):
        now = e * epoch_s
        arrived: set[str] = set()
        if ledger is not None:
            ledger.advance(now)
        for op in ops:
            if type(op) is Depart:
                sim.take(op.request_id)
                if ledger is not None:
                    ledger.depart(op.request_id)
            elif type(op) is Update:
                device, _ = sim.take(op.request_id)
                sim.put(op.request_id, device, op.size)  # KV grows where the request runs
                if ledger is not None:
                    ledger.update(op.request_id, op.size)
            else:
                _route(sim, router, op, now)
                arrived.add(op.request_id)
        view = sim.view(now, epoch_s, link_budget_bytes, prefill_budget_tokens)
        for effect in core.step(view):
            core.dispatched(effect.plan_id)
            for action in effect.actions:
                if isinstance(action, Migrate):
                    device, size = sim.take(action.request_id)
                    assert device == action.source, f"{action.request_id} is on {device}, not {action.source}"
                    sim.put(action.request_id, action.destination, size)
                    if ledger is not None:
                        ledger.move(action.request_id, size, device, action.destination, now,
                                    kv=action.mode == "kv", used=sim.used.__getitem__)
                    n_moves += 1
                    misroutes += action.request_id in arrived
            core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=now, duration_s=0.0))
        for placement in core.placement_hints(view) if hints else ():
            router.take_hints(placement)
        active[e] = sim.active()
        if ledger is not None:
            ledger.retry(now, sim.where.get, sim.used.__getitem__)
            active[e], _ = ledger.occupancy((d for d in sim.ids if sim.held[d]), sim.used.__getitem__)
        if check and ops:
            if max(sim.used.values()) > schedule.capacity:
                overcommitted += 1
            if sum(sim.used.values()) != schedule.used_bytes[e]:
                raise AssertionError(f"{name}: epoch {e}: devices hold {sum(sim.used.values())} B of KV, requests "
                                     f"{int(schedule.used_bytes[e])} B (a request was lost or duplicated)")
    return CorePackingResult(policy=name, active=active, moves=n_moves, moves_before_dedup=n_moves, max_moves_per_op=-1,
                             overcommitted_epochs=overcommitted, wall_s=time.perf_counter() - started,
                             move_costs=ledger.stats if ledger else None,
                             routes=dict(Counter(router.counts)), misroutes=misroutes, devices=len(sim.ids))


def _route(sim: SimCluster, router: MellRouting, op: Allocate, now: float) -> None:
    """The dispatcher's placement of an arrival: admission's room check, then `mell` routing."""
    request = RouteRequest(request_id=op.request_id, model=MODEL, prompt_tokens=op.size // sim.bpt, max_tokens=1)
    room = with_room(request, sim.route_views())
    chosen = router.choose(request, room, now) if room else None
    if chosen is None:
        raise RuntimeError(f"no simulated device has room for {op.request_id} ({op.size} B) among {len(sim.ids)}: "
                           "raise `devices`")
    sim.put(op.request_id, chosen, op.size)


__all__ = ["CorePackingResult", "SimCluster", "device_count", "run_core"]
