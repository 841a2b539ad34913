"""`EvictPrefixBlocks`: the memory economy gives up an instance's cached-free prefix blocks.

What the planner's `ReleasePrefixBlocks` sends (shared/planner/arbiter_prefix.py buys it when an
instance's cached prefixes are the cheapest memory on its worker). The engine's `prefix_cache`
(`PrefixCache.evict(n)`: least recently used first, never a block a running request holds) runs on the
instance's engine thread; the freed blocks become free KV blocks there, which the worker's pool lends to
whoever needs them. Run once per idempotency key (ctl_idempotency.py): a retried command frees nothing
twice. Answered `CtlDone` with the entries (token blocks) and bytes freed, `not_found` for an unknown
instance, `unsupported` when its engine caches no prefixes.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from services.gpu_worker.ctl_idempotency import IdempotentCommands
from shared.bus import Delivery
from shared.events.ctl import CtlDone, CtlRefused, CtlRefusedCode, CtlReply, EvictPrefixBlocks
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.gpu_worker.worker_context import WorkerContext

log = get_logger("tidal.gpu_worker.prefix_ctl")


def _evict_on_engine(engine: Any, n: int) -> tuple[int, int]:
    """On the engine thread: (entries evicted, per-layer KV blocks freed)."""
    cache = engine.prefix_cache
    before = getattr(cache, "cached_free_kv_blocks", None)
    done = int(cache.evict(n))
    after = getattr(cache, "cached_free_kv_blocks", None)
    freed = before - after if isinstance(before, int) and isinstance(after, int) else 0
    return done, max(0, freed)


class PrefixControl:
    def __init__(self, worker: "WorkerContext") -> None:
        self.worker = worker
        self._tasks: set[asyncio.Task[None]] = set()
        self.commands: IdempotentCommands[EvictPrefixBlocks] = IdempotentCommands(
            run=self._run, refused=self._refused, spawn=self._spawn, failed_message="prefix eviction failed")

    async def handle(self, msg: EvictPrefixBlocks, ctx: Delivery) -> CtlReply | None:
        return self.commands.handle(msg, ctx, self.worker.bus)  # answered from its own task

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: EvictPrefixBlocks) -> CtlReply:
        inst = self.worker.instances.get(msg.instance_id)
        if inst is None:
            return self._refused(msg, "not_found", f"no instance {msg.instance_id!r} on {self.worker.worker_id}")
        if getattr(getattr(inst, "engine", None), "prefix_cache", None) is None:
            return self._refused(msg, "unsupported", f"instance {msg.instance_id!r} caches no prefixes")
        got = await inst.run_on_engine(lambda engine: _evict_on_engine(engine, msg.blocks))
        done, kv_blocks = got if isinstance(got, tuple) else (0, 0)
        freed = kv_blocks * int(getattr(inst, "block_bytes", 0))
        log.info("cached prefix blocks released", instance_id=msg.instance_id, asked=msg.blocks, evicted=done,
                 freed_bytes=freed, plan_id=msg.plan_id)
        if done:
            await self.worker.publish_stats()  # the planner sees the freed bytes now
        return CtlDone(idempotency_key=msg.idempotency_key, command=type(msg).__name__, worker_id=self.worker.worker_id,
                       detail=f"{done} of {msg.blocks} cached prefix blocks of {msg.instance_id} released "
                              f"({freed} bytes)")

    def _refused(self, msg: EvictPrefixBlocks, code: CtlRefusedCode, message: str) -> CtlRefused:
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                          worker_id=self.worker.worker_id, code=code, message=message[:1000])


__all__ = ["PrefixControl"]
