"""What the HTTP handlers share: config and limits, the catalog, tokenizers, the NATS hub, drain state.

One instance per gateway process (`app.state.gateway`). The hub exists once the bus is
connected; until then (and while draining) generation endpoints answer 503.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from services.gateway.auth import ApiKeys
from services.gateway.catalog import ModelCatalog, Target
from services.gateway.residency import ResidencyTable
from services.gateway.errors import ApiError
from services.gateway.generation import Generation
from services.gateway.hub import StreamHub
from services.gateway.metrics import INFLIGHT_STREAMS
from services.gateway.rate_limit import RateLimiter
from services.gateway.tokenizers import TokenizerCache, config_dirs
from shared.config import ClusterConfig


class GatewayState:
    def __init__(self, config: ClusterConfig, catalog: ModelCatalog, *, is_draining: Callable[[], bool]) -> None:
        gw = config.gateway
        self.config = config
        self.limits = gw.limits
        self.max_body_bytes = int(gw.limits.max_body_bytes)
        self.request_timeout_s = float(gw.limits.request_timeout)
        self.stream_stall_timeout_s = float(gw.limits.stream_stall_timeout)
        self.api_keys = ApiKeys(gw.api_keys)
        self.rate_limiter = RateLimiter(gw.rate_limit.requests_per_s, gw.rate_limit.burst)
        self.catalog = catalog
        self.residency = ResidencyTable()  # where adapters are warm (fed by ResidencyWatch in the server)
        self.tokenizers = TokenizerCache(config_dirs(config))
        self.hub: StreamHub | None = None
        self.is_draining = is_draining
        self.generations: set[Generation] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self.is_draining()

    def require_hub(self) -> StreamHub:
        if self.draining:
            raise ApiError.unavailable("draining", "The gateway is shutting down; retry the request.", 1.0)
        if self.hub is None:
            raise ApiError.unavailable("no_capacity", "The gateway is still starting; retry shortly.", 1.0)
        return self.hub

    def resolve(self, model: str) -> Target:
        target = self.catalog.resolve(model)
        if target is not None:
            return target
        if not self.catalog.loaded.is_set():
            raise ApiError.unavailable("no_capacity", "The model catalog is not loaded yet; retry shortly.", 1.0)
        raise ApiError.model_not_found(model)

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.hub is None or not self.catalog.loaded.is_set():
            return False, "starting: the model catalog is not loaded yet"
        if not self.catalog.live_instances():
            return False, "no worker serves any model"
        return True, "ready"

    def begin(self, gen: Generation, route: str) -> None:
        """Count `gen` as in flight (drain waits for it) until it closes."""
        self.generations.add(gen)
        self._idle.clear()
        gauge = INFLIGHT_STREAMS.labels(route)
        gauge.inc()

        def ended() -> None:
            gauge.dec()
            self.generations.discard(gen)
            if not self.generations:
                self._idle.set()

        gen.on_closed = ended

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no generation is in flight, at most `timeout_s`; True if idle."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return False

    async def abandon_all(self) -> None:
        for gen in list(self.generations):
            await gen.abandon("cancelled")


__all__ = ["GatewayState"]
