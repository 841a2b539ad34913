"""Pipeline-parallel buddy groups in the simulator (KunServe §3-§4): a group's step cost, and
moving requests between simulated workers when instances merge into a group or split back.

A group of k instances keeps one copy of the model, L/k layers per member, and runs k
micro-batches so every stage stays busy. In one pipeline round each micro-batch advances one
token through all k stages; every GPU reads its layers' weights once per micro-batch and only
its layers' KV, so a round over the group's whole batch takes

    round = overhead + (ctx reads + prefill work) / k + k x (stage_overhead + activation hop)

where `overhead`, the context and prefill coefficients are one unsplit instance's
(loadgen/sim/profile.py) and the hop is an activation over the group's link. That is a
SimWorker with a derived StepCost (`group_cost`): unsplit k = 1 is the same formula with no
pipeline terms. While the victims' KV is exchanged after a drop (§4.2), each round also pays
remote attention: a round trip on the link per layer whose KV is not local yet.

Moving requests keeps their progress exactly: a decoding request keeps its context and tokens,
a prefilling one the tokens it computed; KV blocks are recounted on the target. `settle` first
brings a worker to a step boundary (the step in progress counts as done at that instant: an
error of at most one step per regroup).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from heapq import heappush

from loadgen.sim.profile import LinkSpec, StepCost
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker


@dataclass(frozen=True)
class PipelineCost:
    stage_overhead_s: float  # per stage per micro-batch: scheduling, launch, sync (calibrated, see repro setup)
    activation_bytes: int  # hidden state of one round's micro-batch crossing a stage boundary
    num_layers: int


def group_cost(base: StepCost, stages: int, link: LinkSpec, pipe: PipelineCost, *, exchanging: bool = False) -> StepCost:
    """The StepCost of a `stages`-member group (1: the unsplit instance itself)."""
    if stages == 1 and not exchanging:
        return base
    hop = link.transfer_s(pipe.activation_bytes) if stages > 1 else 0.0
    remote = pipe.num_layers * 2 * link.latency_s if exchanging else 0.0
    return StepCost(overhead_s=base.overhead_s + stages * (pipe.stage_overhead_s + hop) + remote,
                    decode_per_seq_s=base.decode_per_seq_s / stages,
                    decode_per_ctx_token_s=base.decode_per_ctx_token_s / stages,
                    prefill_per_token_s=base.prefill_per_token_s / stages, prefill_attn_s=base.prefill_attn_s / stages)


def set_cost(w: SimWorker, cost: StepCost) -> None:
    """Swap a settled worker's step cost (the worker caches its coefficients)."""
    w.cost = cost
    w.c_over, w.c_seq, w.c_ctx = cost.overhead_s, cost.decode_per_seq_s, cost.decode_per_ctx_token_s


def settle(w: SimWorker, now: float) -> None:
    """Bring a worker to a step boundary at `now`; its pending step event becomes stale."""
    if w.busy:
        if w.run_k > 1:
            w._truncate(now)
        w.complete(now)
    w.gen += 1


@dataclass
class Moved:
    decoding: list[tuple[SimRequest, int, int]]  # (request, context tokens, tokens generated)
    prefilling: list[SimRequest]
    waiting: list[SimRequest]


def take_all(w: SimWorker) -> Moved:
    """Every request of a settled worker, which is left empty."""
    decoding = []
    for _, _, epoch, req in w.heap:
        if epoch != req.epoch:
            continue
        done = w.step - req.start_step
        decoding.append((req, req.ctx0 + done, req.gen_at_start + done))
        req.epoch += 1
    moved = Moved(decoding, list(w.prefilling), list(w.waiting))
    w.heap, w.prefilling, w.waiting = [], [], deque()
    w.decoding = w.ctx_sum = w.used = w.queued_tokens = 0
    w.phase_count = [0] * w.bs
    return moved


def take_one(w: SimWorker, req: SimRequest) -> tuple[int, int] | None:
    """Remove one decoding request from a settled worker: its (context, generated), or None if it
    is not decoding there any more."""
    if req.status != "ok" or req.finish >= 0 or req.worker != w.worker_id:
        return None
    if not any(e[3] is req and e[2] == req.epoch for e in w.heap):
        return None
    done = w.step - req.start_step
    ctx, gen = req.ctx0 + done, req.gen_at_start + done
    w._drop_decoding(req, ctx)
    return ctx, gen


def put_decoding(w: SimWorker, req: SimRequest, ctx: int, generated: int) -> None:
    req.ctx0, req.start_step, req.gen_at_start, req.generated = ctx, w.step, generated, generated
    req.worker = w.worker_id
    w.phase_count[(ctx - w.step) % w.bs] += 1
    w.decoding += 1
    w.ctx_sum += ctx
    w.used += -(-ctx // w.bs)
    heappush(w.heap, (w.step + req.output - generated, req.order, req.epoch, req))


def put_all(w: SimWorker, moved: Moved) -> None:
    """Requests into a settled worker: decoding ones decode on, the rest queue in arrival order."""
    for req, ctx, gen in moved.decoding:
        put_decoding(w, req, ctx, gen)
    for req in moved.prefilling:
        req.worker = w.worker_id
        w.prefilling.append(req)
        w.used += -(-req.computed // w.bs)
        w.queued_tokens += req.to_prefill - req.computed
    waiting = sorted([*w.waiting, *moved.waiting], key=lambda r: r.order)
    for req in moved.waiting:
        req.worker = w.worker_id
        w.queued_tokens += req.to_prefill
    w.waiting = deque(waiting)


def overflow(w: SimWorker, others: list[SimWorker]) -> list[tuple[SimRequest, SimWorker]]:
    """Take the queued requests of `w` beyond its batch limit off its queue, newest first, each to
    the other worker with the most free KV among those not blocked on memory, with batch room and
    free blocks for it (after their own queues); stops at the first that fits nowhere."""
    room = w.spec.max_batch - w.decoding - len(w.prefilling)
    moves: list[tuple[SimRequest, SimWorker]] = []
    sent: dict[int, tuple[int, int]] = {}  # target index -> (requests, blocks) sent by this call

    def fits(o: SimWorker, need: int) -> bool:
        n, blocks = sent.get(o.index, (0, 0))
        return (o.blocked_on != "memory" and o.decoding + len(o.prefilling) + len(o.waiting) + n < o.spec.max_batch
                and o.total - o.used - -(-o.queued_tokens // o.bs) - blocks >= need)

    for req in reversed(list(w.waiting)[max(0, room):]):
        need = -(-req.to_prefill // w.bs) + 1
        spare = [o for o in others if fits(o, need)]
        if not spare:
            break
        target = max(spare, key=lambda o: (o.total - o.used - sent.get(o.index, (0, 0))[1], -o.index))
        w.waiting.remove(req)
        w.queued_tokens -= req.to_prefill
        n, blocks = sent.get(target.index, (0, 0))
        sent[target.index] = (n + 1, blocks + need)
        moves.append((req, target))
    return moves


__all__ = ["Moved", "PipelineCost", "group_cost", "overflow", "put_all", "put_decoding", "set_cost", "settle", "take_all",
           "take_one"]
