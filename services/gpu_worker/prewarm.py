"""Prewarmed weights in the worker's one pool (WarmServe §4): kind `prewarm`, tenant `prewarm`.

A model is *warm* here when its weights (some first layers, or all of it) sit in device memory
without an instance serving it: the layers a `Prewarm` command read ahead of demand, or the
weights of an instance that `EvictModel` stopped, kept through the grace period. A `LoadModel`
of a warm model takes them (`take`) and the new runner uses the same tensors: no copy, no
checkpoint read for what was warm.

Switching costs nothing on either side:
* an evicted instance's weight charges become prewarm charges under the pool's lock in one step
  (`put(..., from_tenant=...)`: released and charged again, the bytes never free in between);
* prewarmed bytes are the cheapest memory of the pool: a serving instance whose KV runs short
  (`MemoryPool.reclaim_kv`) or a charge that does not fit takes them, whole models at a time,
  the soonest to expire first — a worker dedicated to one model turns the others' warm bytes into
  KV blocks, and no live KV is ever copied (KV regions are reserved for the whole pool).

Thread-safe: the engine threads reclaim through the pool, so every method holds the pool's lock.

A `Prewarm`'s checkpoint read yields to serving (`ServingGate`): it reads layer by layer on its own
thread, and before each layer waits while the worker has requests (the read's CPU, and on CPU workers
the interpreter, would otherwise be taken from their steps), for at most `max_wait_s` in all; then it
reads on, so a prewarm on a worker that never idles still lands.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gpu_worker.engine.memory_pool import ChargeHandle, MemoryKind, MemoryPool
from services.gpu_worker.engine.preloaded import PreloadedWeights
from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.prewarm")

PREWARM_TENANT = "prewarm"


@dataclass(slots=True)
class Warm:
    model: str
    weights: PreloadedWeights
    source: str  # "evicted" (grace period) or "prewarm" (a Prewarm command)
    expires_at: float  # math.inf: until taken or reclaimed
    handles: list[ChargeHandle] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes


class PrewarmStore:
    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self.models: dict[str, Warm] = {}
        self.reclaimed: list[str] = []  # models dropped for room (read by metrics/logs on the event loop)
        pool.register_reclaimer(MemoryKind.PREWARM, self._reclaim, PREWARM_TENANT)

    def put(self, model: str, weights: PreloadedWeights, *, source: str, expires_at: float = math.inf,
            from_tenant: str | None = None) -> int:
        """Hold `weights` warm; returns their bytes. With `from_tenant` (an instance being retired)
        all that tenant's charges are released and the weights charged as prewarm under one lock, so
        the bytes switch kind without ever being free. Raises PoolExhausted if they cannot fit."""
        with self.pool.lock:
            if from_tenant is not None:
                self.pool.release_tenant(from_tenant)
            self._drop(model)  # a newer copy replaces an older one
            warm = Warm(model, weights, source, expires_at)
            try:
                for part, nbytes in weights.parts().items():
                    warm.handles.append(self.pool.charge(MemoryKind.PREWARM, f"{model}:{part}", nbytes,
                                                         reclaim=from_tenant is None, tenant=PREWARM_TENANT))
            except MemoryError:
                for handle in warm.handles:
                    self.pool.release(handle)
                raise
            self.models[model] = warm
            return warm.nbytes

    def take(self, model: str) -> PreloadedWeights | None:
        """The model's warm weights, released from the pool's prewarm kind for a runner to charge as
        its weights (None: not warm here)."""
        with self.pool.lock:
            warm = self.models.get(model)
            if warm is None:
                return None
            self._drop(model)
            return warm.weights

    def release(self, model: str) -> int:
        """Free a model's warm bytes (0 when none)."""
        with self.pool.lock:
            return self._drop(model)

    def expire(self, now: float) -> list[tuple[str, int]]:
        """Free the models whose grace period ended by `now`: [(model, bytes)]."""
        with self.pool.lock:
            gone = [(m, w.nbytes) for m, w in self.models.items() if w.expires_at <= now]
            for model, _ in gone:
                self._drop(model)
            return gone

    def bytes_of(self, model: str) -> int:
        with self.pool.lock:
            warm = self.models.get(model)
            return warm.nbytes if warm is not None else 0

    def layers_of(self, model: str) -> int:
        """How many first layers of `model` are warm here."""
        with self.pool.lock:
            warm = self.models.get(model)
            return warm.weights.first_layers if warm is not None else 0

    def _drop(self, model: str) -> int:
        warm = self.models.pop(model, None)
        if warm is None:
            return 0
        return sum(self.pool.release(h) for h in warm.handles)

    def _reclaim(self, missing: int, _keep_floor: bool) -> int:
        """The pool is short: drop whole warm models, the soonest to expire (then the largest) first."""
        given = 0
        for warm in sorted(self.models.values(), key=lambda w: (w.expires_at, -w.nbytes)):
            if given >= missing:
                break
            given += self._drop(warm.model)
            self.reclaimed.append(warm.model)
            log.info("prewarmed weights given up for room", model=warm.model, bytes=warm.nbytes, missing=missing)
        return given


class ServingGate:
    """Called on the reading thread before each layer: waits while `serving()` holds, `max_wait_s` in all."""

    def __init__(self, serving: Callable[[], bool], max_wait_s: float, poll_s: float = 0.02) -> None:
        if max_wait_s < 0 or poll_s <= 0:
            raise ValueError(f"need max_wait_s >= 0 and poll_s > 0, got {max_wait_s} and {poll_s}")
        self.serving, self.max_wait_s, self.poll_s = serving, max_wait_s, poll_s
        self.waited_s = 0.0  # how long the read yielded, in all
        self.pauses = 0  # layers read only after a wait

    def __call__(self) -> None:
        if not self.serving() or self.waited_s >= self.max_wait_s:
            return
        self.pauses += 1
        started = time.monotonic()
        while self.serving() and time.monotonic() - started + self.waited_s < self.max_wait_s:
            time.sleep(self.poll_s)
        self.waited_s += time.monotonic() - started


__all__ = ["PREWARM_TENANT", "PrewarmStore", "ServingGate", "Warm"]
