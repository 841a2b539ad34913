"""KV-cache packing simulation (MELL §VI-A's model): how many devices a placement policy
keeps active while requests arrive, grow token by token and leave.

Each request is pre-allocated KV for its prompt on arrival (MELL Fig. 2), finishes prefill
after `prompt x prefill_s_per_token`, then adds one token of KV every `decode_step_s`
until its output is done. Request lifetimes do not depend on placement: MELL's Fig. 3
shows per-token latency flat over batch sizes 2-16, and the paper itself replays measured
speeds in a simulator (§VIII-B). The KV a request holds is reported in granules (vLLM-style
blocks, coarser to keep the op count low): `reserve(tokens) = ceil(tokens / g) * g`.

This replays a fixed op stream: right for policies that never hold more than a device can (MELL; the
hindsight arms that reserve final sizes). Where requests wait or are preempted, their timing depends on
placement: kv_packing_fleet.py plays that out (`tidal repro mell` runs its arms there).

Moves are not free: `run_policy(..., moves=MoveModel)` charges every policy's moves alike through
the one movement cost model (kv_packing_moves.py: Llumnix's pre-copy, a stall, failures and
retries; token-mode re-prefill), and counts a GPU as active while a copy still holds its memory.
Without a MoveModel, moves are instant: placement-only unit tests use that.

Time runs in planning intervals (epochs). At each epoch boundary the policy gets one batch:
Depart for requests that finished, Update for requests whose reserved KV grew, Allocate for
arrivals (sized at the boundary). The op stream is built once (`build_schedule`) and every
policy replays the same one (`run_policy`), so only placement differs between them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from loadgen.sim.kv_packing_moves import MoveLedger, MoveModel, MoveStats, request_end_times
from shared.policy.mell_ops import Allocate, Depart, Update


@dataclass(frozen=True)
class Schedule:
    epoch_s: float
    capacity: int  # KV bytes per device
    bytes_per_token: int
    epochs: list[list[Allocate | Depart | Update]]  # ops of the batch at the end of epoch e
    used_bytes: np.ndarray  # per epoch: KV reserved by all live requests after the batch (policy-independent)
    requests: int
    truncated: int  # requests whose prompt + output was clipped to one device's KV capacity
    end_s: np.ndarray | None = None  # per request: when its last token is out (a move cannot hand over after)
    # per request, after clipping (the fleet simulation replays requests whose timing depends on placement):
    arrival_s: np.ndarray | None = None
    prompt: np.ndarray | None = None
    output: np.ndarray | None = None
    first_token_s: np.ndarray | None = None  # prefill done, first token out (undelayed)
    granule_tokens: int = 1
    decode_step_s: float = 0.0
    prefill_s_per_token: float = 0.0

    @property
    def duration_s(self) -> float:
        return len(self.epochs) * self.epoch_s


@dataclass(frozen=True)
class PackingResult:
    policy: str
    active: np.ndarray  # active devices after each epoch's batch
    moves: int  # moves executed (after batching's dedup where the policy batches)
    moves_before_dedup: int
    max_moves_per_op: int  # only measured when ops run one by one (`per_op=True`), else -1
    overcommitted_epochs: int  # epochs where some device's books held more than its capacity (must be 0)
    wall_s: float
    move_costs: MoveStats | None = None  # what the moves cost (None: moves were instant)

    def peak_devices(self) -> int:
        return int(self.active.max(initial=0))

    def mean_devices(self) -> float:
        return float(self.active.mean()) if len(self.active) else 0.0


def build_schedule(arrival_s: np.ndarray, prompt: np.ndarray, output: np.ndarray, *, capacity: int,
                   bytes_per_token: int, granule_tokens: int, epoch_s: float, prefill_s_per_token: float,
                   decode_step_s: float) -> Schedule:
    if epoch_s <= 0 or decode_step_s <= 0 or prefill_s_per_token < 0 or granule_tokens < 1:
        raise ValueError("need epoch_s > 0, decode_step_s > 0, prefill_s_per_token >= 0, granule_tokens >= 1")
    cap_tok = capacity // bytes_per_token
    if cap_tok < 2:
        raise ValueError(f"capacity {capacity} B holds fewer than 2 tokens of {bytes_per_token} B")
    arrival = np.asarray(arrival_s, np.float64)
    p = np.minimum(np.asarray(prompt, np.int64), cap_tok - 1)
    o = np.minimum(np.asarray(output, np.int64), cap_tok - p)
    o = np.maximum(o, 1)
    truncated = int(np.count_nonzero((p + o) < (np.asarray(prompt) + np.asarray(output))))
    n = len(arrival)
    t_first = arrival + p * prefill_s_per_token
    t_end = t_first + (o - 1) * decode_step_s
    ea = np.floor(arrival / epoch_s).astype(np.int64) + 1  # boundaries after arrival / end
    ed = np.maximum(ea + 1, np.floor(t_end / epoch_s).astype(np.int64) + 1)
    lives = ed - ea
    total = int(lives.sum())
    idx = np.repeat(np.arange(n), lives)
    starts = np.concatenate(([0], np.cumsum(lives)[:-1]))
    e = ea[idx] + (np.arange(total) - starts[idx])
    since = e * epoch_s - t_first[idx]
    grown = np.where(since < 0, 0, np.minimum(o[idx], np.floor(since / decode_step_s).astype(np.int64) + 1))
    tokens = p[idx] + grown
    reserved = np.minimum(-(-tokens // granule_tokens) * granule_tokens, cap_tok)
    first = np.zeros(total, bool)
    first[starts] = True
    changed = np.ones(total, bool)
    changed[1:] = reserved[1:] != reserved[:-1]
    update = changed & ~first
    n_epochs = int(ed.max(initial=0)) + 1
    used = np.bincount(e, weights=reserved, minlength=n_epochs)[:n_epochs] * bytes_per_token

    epochs: list[list[Allocate | Depart | Update]] = [[] for _ in range(n_epochs)]
    ids = [f"r{i}" for i in range(n)]
    for i, epoch in enumerate(ed.tolist()):
        epochs[epoch].append(Depart(request_id=ids[i]))
    for k in np.flatnonzero(update).tolist():
        epochs[int(e[k])].append(Update(request_id=ids[int(idx[k])], size=int(reserved[k]) * bytes_per_token))
    for k in starts.tolist():
        epochs[int(e[k])].append(Allocate(request_id=ids[int(idx[k])], size=int(reserved[k]) * bytes_per_token))
    return Schedule(epoch_s=epoch_s, capacity=capacity, bytes_per_token=bytes_per_token, epochs=epochs,
                    used_bytes=used.astype(np.int64), requests=n, truncated=truncated, end_s=t_end,
                    arrival_s=arrival, prompt=p, output=o, first_token_s=t_first, granule_tokens=granule_tokens,
                    decode_step_s=decode_step_s, prefill_s_per_token=prefill_s_per_token)


def apply_op(policy, op):  # type: ignore[no-untyped-def]
    """One operation on a policy (MellScheduler or a bin-packing baseline): its result."""
    if type(op) is Depart:
        return policy.depart(op.request_id)
    if type(op) is Update:
        return policy.update(op.request_id, op.size)
    return policy.allocate(op.request_id, op.size)


def run_policy(schedule: Schedule, policy, name: str, *, per_op: bool = False, check: bool = True,
               moves: MoveModel | None = None) -> PackingResult:
    """Replay the schedule on `policy` (MellScheduler or a baseline). per_op: ops one by one
    (departs, updates, allocates, as batching orders them) to measure moves per operation.
    `moves`: what each move costs (kv_packing_moves.py); the active GPUs then include those a copy
    still occupies."""
    started = time.perf_counter()
    active = np.zeros(len(schedule.epochs), np.int64)
    n_moves = before = 0
    max_per_op = 0 if per_op else -1
    overcommitted = 0
    count = 0
    ledger = None
    if moves is not None:
        if schedule.end_s is None:
            raise ValueError(f"{name}: charging moves needs the schedule's request end times")
        ledger = MoveLedger(moves, schedule.capacity, request_end_times(schedule.end_s))
    kv = getattr(policy, "migrates", True)  # MellScheduler and LB migrate KV; the restart ablations re-prefill
    size: dict[str, int] = {}
    for e, ops in enumerate(schedule.epochs):
        now = e * schedule.epoch_s
        if ledger is not None:
            ledger.advance(now)
            for op in ops:
                if type(op) is not Depart:
                    size[op.request_id] = op.size
                    ledger.update(op.request_id, op.size)
        if ops:
            if per_op:
                for op in ops:
                    res = apply_op(policy, op)
                    n_moves += len(res.moves)
                    max_per_op = max(max_per_op, len(res.moves))
                    _charge(ledger, res.moves, size, now, kv, policy)
                before = n_moves
            else:
                res = policy.run_batch(ops)
                n_moves += len(res.moves)
                before += res.moves_before_dedup
                _charge(ledger, res.moves, size, now, kv, policy)
            devices = policy.active_devices()
            count = len(devices)
            if check:
                used = [policy.used(d) for d in devices]
                if max(used, default=0) > schedule.capacity:
                    overcommitted += 1
                if sum(used) != schedule.used_bytes[e]:
                    raise AssertionError(f"{name}: epoch {e}: devices hold {sum(used)} B of KV, requests "
                                         f"{int(schedule.used_bytes[e])} B (a request was lost or duplicated)")
        if ledger is not None:
            for op in ops:  # after the moves: one op run alone may move a request departing later in the batch
                if type(op) is Depart:
                    ledger.depart(op.request_id)
                    del size[op.request_id]
            ledger.retry(now, policy.device_of, policy.used)
            count, _ = ledger.occupancy(policy.active_devices(), policy.used)
        active[e] = count
    return PackingResult(policy=name, active=active, moves=n_moves, moves_before_dedup=before,
                         max_moves_per_op=max_per_op, overcommitted_epochs=overcommitted,
                         wall_s=time.perf_counter() - started, move_costs=ledger.stats if ledger else None)


def _charge(ledger: MoveLedger | None, moves, size: dict[str, int], now: float, kv: bool, policy) -> None:
    if ledger is not None:
        for m in moves:
            ledger.move(m.request_id, size[m.request_id], m.source, m.destination, now, kv=kv, used=policy.used)


def utilisation(schedule: Schedule, result: PackingResult) -> float:
    """Time-averaged share of the active devices' KV memory in use (MELL §VIII-B metric 3): the granules of
    the running requests (a fleet run's own, where requests waited; else the schedule's) over the active
    devices' KV capacity."""
    provisioned = float(result.active.sum()) * schedule.capacity
    used = getattr(result, "used_bytes", None)
    if used is None:
        used = schedule.used_bytes[: len(result.active)]
    return float(used.sum()) / provisioned if provisioned else 0.0
