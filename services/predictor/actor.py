"""The live predictor: dispatcher stats in, per-model windows kept in JetStream, forecasts out.

Every `DispatchStats` is counted into its window (services/predictor/windows.py). Once a window
has ended and late stats from other dispatchers can no longer come (two stats intervals), it is
closed: each known model's avg and peak rate is appended to its history, the history is
written to JetStream, and then the CSP forecast (shared/policy/warmserve_predictor.py) of the
window now starting is published on `tidal.v1.predict.<model>`. Known models: the config's,
those with a stored history, those seen in stats. The windows still filling are flushed every
second while they change, and at shutdown, so a restart (or a crash, less the last second)
loses nothing; several windows that ended while the predictor was down are recorded missing.
"""
from __future__ import annotations

import asyncio
import time

import nats.errors

from shared.actors import Actor
from shared.bus import Delivery
from shared.config import ClusterConfig
from shared.events.dispatch import DispatchStats
from shared.events.predict import Forecast
from shared.logging import get_logger
from shared.policy.warmserve_predictor import CspParams, forecast
from shared.subjects import dispatch_stats, predict_forecast
from shared.wire import TidalError

from services.predictor import metrics
from services.predictor.store import HistoryStore
from services.predictor.windows import ModelHistory, WindowBook, WindowLoad

log = get_logger("tidal.predictor")

_IO_ERRORS = (TidalError, OSError, asyncio.TimeoutError, nats.errors.Error)


class Predictor(Actor):
    def __init__(self, config: ClusterConfig, instance: str) -> None:
        super().__init__("predictor")
        p = config.predictor
        self.instance = instance
        self.window_s = float(p.window)
        self.keep = int(p.history_windows)
        self.replicas = int(config.registry.replicas)
        self.params = CspParams.for_windows(self.window_s, float(p.season), lookback=int(p.lookback))
        stats_interval = float(config.dispatcher.stats_interval)
        self.book = WindowBook(self.window_s, float(p.peak_slot), grace_s=2 * stats_interval)
        if float(p.peak_slot) < stats_interval:
            log.warning("peak_slot is shorter than the dispatcher's stats interval: peaks will read high",
                        peak_slot=float(p.peak_slot), stats_interval=stats_interval)
        self.tick_s = min(1.0, self.window_s / 4)
        self.models: set[str] = {m.name for m in config.models}
        self.histories: dict[str, ModelHistory] = {}
        self.unsaved: set[str] = set()  # models whose history JetStream does not have yet
        self.open_dirty = False
        self.store: HistoryStore | None = None

    async def on_start(self) -> None:
        self.store = HistoryStore(self.bus, replicas=self.replicas)
        await self.store.open()
        self.histories, opened = await self.store.load(self.window_s)
        if opened is not None and not self.book.restore(opened):
            log.warning("stored open windows were cut differently; starting them afresh")
        self.models |= set(self.histories)
        log.info("history loaded", models=sorted(self.histories),
                 windows=sum(len(h.avg) for h in self.histories.values()),
                 open_windows=len(self.book.state.windows))
        await self.bind(dispatch_stats(), DispatchStats, self.on_stats)
        self.spawn("windows", self._window_loop)

    async def on_stop(self) -> None:
        await self._persist()

    async def on_stats(self, msg: DispatchStats, _ctx: Delivery) -> None:
        skipped = self.book.add(msg, time.time())
        if skipped is not None:
            metrics.SKIPPED.labels(skipped).inc()
            log.info("dispatch stats skipped", reason=skipped, dispatcher=msg.dispatcher_id, ts=msg.ts)
            return
        metrics.STATS.inc()
        self.models.update(m.model for m in msg.models if m.admitted + m.rejected)
        self.open_dirty = True

    async def _window_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            async with self.turn():
                await self.step(time.time())

    async def step(self, now: float) -> list[Forecast]:
        """Close the windows that are due, persist, then publish the next window's forecasts."""
        closed = None
        for w in self.book.due(now):
            self._record(w, self.book.close(w, self.models))
            closed = w
            self.open_dirty = True
        if not await self._persist() or closed is None:
            return []  # nothing new, or not yet stored: forecasts follow what JetStream holds
        return await self._publish(closed + 1, now)

    def _record(self, w: int, loads: dict[str, WindowLoad] | None) -> None:
        metrics.WINDOWS.labels("yes" if loads is not None else "no").inc()
        for model in sorted(self.models | set(loads or {})):
            history = self.histories.get(model)
            if history is None:
                history = self.histories[model] = ModelHistory(model=model, window_s=self.window_s, first_window=w)
            elif history.avg and history.next_window() > w:
                continue  # stored before a crash that came ahead of the open windows' flush
            load = None if loads is None else loads.get(model)
            history.append(w, None if load is None else load.avg_rps, None if load is None else load.peak_rps,
                           self.keep)
            self.unsaved.add(model)
        self.models |= set(loads or {})

    async def _persist(self) -> bool:
        """Write what JetStream lacks; False when a write failed (retried at the next tick)."""
        assert self.store is not None
        try:
            for model in sorted(self.unsaved):
                await self.store.save_history(self.histories[model])
                self.unsaved.discard(model)
            if self.open_dirty:
                await self.store.save_open(self.book.state)
                self.open_dirty = False
        except _IO_ERRORS as exc:
            metrics.PERSIST_ERRORS.inc()
            log.warning("predictor history not stored; retrying", error=repr(exc))
            return False
        return True

    async def _publish(self, w: int, now: float) -> list[Forecast]:
        out = []
        for model in sorted(self.histories):
            h = self.histories[model]
            fc = forecast(h.avg, h.peak, w - h.first_window, self.params)
            last = h.avg[-1] if h.avg and h.next_window() == w else None
            msg = Forecast(model=model, predictor_id=self.instance, issued_ts=now, window_start_ts=w * self.window_s,
                           window_s=self.window_s, avg_rps=fc.avg, peak_rps=fc.peak, observed_rps=last)
            try:
                await self.bus.publish(predict_forecast(model), msg)
            except _IO_ERRORS as exc:  # NATS away: this window's forecast is lost, the history is not
                log.warning("forecast not published", model=model, error=repr(exc))
                continue
            metrics.FORECASTS.labels(model).inc()
            metrics.FORECAST_RPS.labels(model, "avg").set(fc.avg)
            metrics.FORECAST_RPS.labels(model, "peak").set(fc.peak)
            out.append(msg)
        return out


__all__ = ["Predictor"]
