"""Llumnix (w/ migration) in the buddy-group cluster simulator, with Llumnix's costs.

Every tick, from the instance under the most pressure (KV used plus queued prompts) that has a
queue to the one under the least, one running request at a time per source (Llumnix's SR policy:
the shortest running request, the cheapest to move). The move is Llumnix's live migration as
shared/policy/movement.py models it:
1. the destination reserves the request's blocks (no room: no move) and holds them throughout;
2. pre-copy stages over the KV link while the request keeps decoding on the source;
3. the last stage: the request leaves the source's batch (the stall), its blocks stay held on the
   source until the copy lands, then it decodes on the destination;
4. a move fails, releasing the reservation, when pre-copy does not converge in the stage limit, or
   when the request finished or was preempted on the source before the hand-over.
Nothing here is free: the migration baseline pays what Llumnix pays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loadgen.sim.pipeline import put_decoding, settle, take_one
from loadgen.sim.request import SimRequest

if TYPE_CHECKING:
    from loadgen.sim.buddy_cluster import BuddyCluster, Engine

HANDOVER, LANDED, RELEASE = "handover", "landed", "release"


@dataclass
class Move:
    src: int  # engine ids
    dst: int
    req: SimRequest
    epoch: int  # the request's epoch when the move began: a preemption since makes it stale
    reserved: int  # blocks held on the destination
    held_on_src: int = 0  # blocks still held on the source during the stall


class LlumnixMigration:
    def __init__(self, cluster: BuddyCluster) -> None:
        self.c = cluster
        self.costs = cluster.moves
        self.active: dict[int, Move] = {}  # source engine id -> its move in flight
        self.moved = self.failed = 0
        self.stall_s = 0.0

    def tick(self, now: float) -> None:
        c = self.c

        def pressure(e: Engine) -> float:
            w = e.worker
            return (w.used + w.queued_tokens / w.bs) / w.total

        engines = sorted(c.engines.values(), key=pressure)
        src, dst = engines[-1], engines[0]
        w = src.worker
        if src is dst or w.index in self.active or not w.waiting:
            return
        live = [e[3] for e in w.heap if e[2] == e[3].epoch]
        if not live:
            return
        req = min(live, key=lambda r: r.ctx0 + (w.step - r.start_step))
        ctx = req.ctx0 + (w.step - req.start_step)
        step_s = w.c_over + w.c_seq * w.decoding + w.c_ctx * w.ctx_sum
        plan = self.costs.kv_precopy(ctx, w.bs, c.block_bytes, step_s)
        d = dst.worker
        if d.total - d.used < plan.blocks + d.queued_tokens // d.bs:
            return  # Llumnix: the destination cannot reserve the blocks (ABORTED_DST)
        settle(d, now)
        d.used += plan.blocks  # held on the destination for the whole copy
        c._kick(dst, now)
        move = Move(w.index, d.index, req, req.epoch, plan.blocks)
        self.active[w.index] = move
        if plan.ok:
            c._at(now + plan.precopy_s, 4, (HANDOVER, move, plan.stall_s))
        else:
            c._at(now + plan.precopy_s, 4, (RELEASE, move, 0.0))

    def event(self, payload: tuple[str, Move, float], now: float) -> None:
        kind, move, stall = payload
        c = self.c
        src, dst = c.engines.get(move.src), c.engines.get(move.dst)
        if kind == HANDOVER:
            got = None
            if src is not None and dst is not None and move.req.epoch == move.epoch:
                settle(src.worker, now)
                got = take_one(src.worker, move.req)
            if got is None:  # finished or preempted meanwhile (ABORTED_SRC)
                self._release(move, now)
                if src is not None:
                    c._kick(src, now)
                return
            move.held_on_src = -(-got[0] // src.worker.bs)
            src.worker.used += move.held_on_src
            c._kick(src, now)
            self.stall_s += stall
            c._at(now + stall, 4, (LANDED, move, got))  # type: ignore[arg-type]
        elif kind == LANDED:
            ctx, generated = stall  # type: ignore[misc]
            self.active.pop(move.src, None)
            if src is not None:
                settle(src.worker, now)
                src.worker.used -= move.held_on_src
                c._kick(src, now)
            if dst is not None:
                settle(dst.worker, now)
                dst.worker.used -= move.reserved
                put_decoding(dst.worker, move.req, ctx, generated)
                c._kick(dst, now)
                self.moved += 1
        else:
            self._release(move, now)

    def _release(self, move: Move, now: float) -> None:
        self.active.pop(move.src, None)
        self.failed += 1
        dst = self.c.engines.get(move.dst)
        if dst is not None:
            settle(dst.worker, now)
            dst.worker.used -= move.reserved
            self.c._kick(dst, now)


__all__ = ["LlumnixMigration", "Move"]
