"""The live predictor: dispatcher and worker stats in, per-model windows kept in JetStream, forecasts out.

Every `DispatchStats` is counted into its window (services/predictor/windows.py), and every
`WorkerStats` (with the dispatchers' queues) sampled into its concurrency. Once a window has
ended and late stats from other dispatchers can no longer come (two stats intervals), it is
closed: each known model's avg and peak rate and concurrency are appended to its history, the
history is written to JetStream, and then the ensemble's forecast (shared/policy/forecast_outlook.py:
CSP, last value, seasonal naive and EWMAs weighted by their recent errors, with P50/P90) of the
window now starting, spike-guarded (shared/policy/forecast_guard.py: toward the last value when the
ensemble's last error jumps; the forecast the simulator reads), is published on `tidal.v1.predict.<model>`. Known models: the config's,
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
from shared.events.predict import Forecast, LoadQuantiles, MemberWeight
from shared.events.worker import WorkerStats
from shared.logging import get_logger
from shared.policy.forecast_ensemble import EnsembleForecast, EnsembleParams
from shared.policy.forecast_guard import GuardParams, guarded_at
from shared.policy.forecast_members import MemberParams
from shared.policy.forecast_outlook import LoadOutlook, at_least
from shared.policy.warmserve_predictor import Series
from shared.policy.warmserve_predictor import CspParams
from shared.subjects import dispatch_stats, predict_forecast, worker_stats
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
        self.params = ensemble_params(config)
        self.guard = GuardParams()
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
        await self.bind(worker_stats(), WorkerStats, self.on_worker_stats)
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

    async def on_worker_stats(self, msg: WorkerStats, _ctx: Delivery) -> None:
        if self.book.add_worker(msg, time.time()) is None:  # a late or future sample is only a sample: not counted
            self.models.update(i.model for i in msg.instances if i.running + i.waiting)
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
                           self.keep, None if load is None else load.concurrency)
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

    def _outlooks(self, w: int) -> dict[str, tuple[LoadOutlook, LoadOutlook | None]]:
        """Each model's guarded rate and concurrency outlook for window w (pure CPU: run off the event loop)."""
        out = {}
        for model, h in self.histories.items():
            k = w - h.first_window
            rate = self._outlook(model, "rps", h.avg, h.peak, k)
            seen = any(v is not None for v in h.conc_avg)
            out[model] = (rate, self._outlook(model, "concurrency", h.conc_avg, h.conc_peak, k) if seen else None)
        return out

    def _outlook(self, model: str, load: str, avg_series: Series, peak_series: Series, k: int) -> LoadOutlook:
        """`forecast_outlook.outlook` with each series spike-guarded on its own errors (peak >= avg after)."""
        avg, lam = guarded_at(avg_series, k, self.params, self.guard)
        peak, lam_peak = guarded_at(peak_series, k, self.params, self.guard)
        metrics.GUARD_WEIGHT.labels(model, f"{load}_avg").set(lam)
        metrics.GUARD_WEIGHT.labels(model, f"{load}_peak").set(lam_peak)
        return LoadOutlook(avg=avg, peak=at_least(peak, avg))

    async def _publish(self, w: int, now: float) -> list[Forecast]:
        out = []
        outlooks = await asyncio.to_thread(self._outlooks, w)
        for model in sorted(outlooks):
            h = self.histories[model]
            rate, conc = outlooks[model]
            msg = _forecast(model, self.instance, now, w, self.window_s, rate, conc, h)
            try:
                await self.bus.publish(predict_forecast(model), msg)
            except _IO_ERRORS as exc:  # NATS away: this window's forecast is lost, the history is not
                log.warning("forecast not published", model=model, error=repr(exc))
                continue
            metrics.FORECASTS.labels(model).inc()
            metrics.FORECAST_RPS.labels(model, "avg").set(msg.avg_rps)
            metrics.FORECAST_RPS.labels(model, "peak").set(msg.peak_rps)
            if msg.avg_rps_quantiles is not None:
                metrics.FORECAST_RPS.labels(model, "p90").set(msg.avg_rps_quantiles.p90)
            if msg.avg_concurrency is not None:
                metrics.FORECAST_CONCURRENCY.labels(model, "avg").set(msg.avg_concurrency)
            out.append(msg)
        return out


def ensemble_params(config: ClusterConfig) -> EnsembleParams:
    """The ensemble the predictor runs for `[predictor]` (its windows per season, Eq. 3's lookback)."""
    p = config.predictor
    csp = CspParams.for_windows(float(p.window), float(p.season), lookback=int(p.lookback))
    return EnsembleParams(MemberParams(windows_per_season=csp.windows_per_season, lookback=csp.lookback))


def _quantiles(fc: EnsembleForecast) -> LoadQuantiles:
    return LoadQuantiles(p50=fc.quantile(0.5), p90=fc.quantile(0.9))


def _forecast(model: str, instance: str, now: float, w: int, window_s: float, rate: LoadOutlook,
              conc: LoadOutlook | None, h: ModelHistory) -> Forecast:
    current = h.next_window() == w
    last = h.avg[-1] if h.avg and current else None
    last_conc = h.conc_avg[-1] if h.conc_avg and current else None
    members = [MemberWeight(name=m.name, weight=min(1.0, max(0.0, m.weight)), avg_rps=max(0.0, m.forecast))
               for m in rate.avg.members]
    return Forecast(
        model=model, predictor_id=instance, issued_ts=now, window_start_ts=w * window_s, window_s=window_s,
        avg_rps=rate.avg.point, peak_rps=rate.peak.point, observed_rps=last, avg_rps_quantiles=_quantiles(rate.avg),
        avg_concurrency=None if conc is None else conc.avg.point,
        peak_concurrency=None if conc is None else conc.peak.point,
        concurrency_quantiles=None if conc is None else _quantiles(conc.avg),
        observed_concurrency=last_conc, members=members)


__all__ = ["Predictor", "ensemble_params"]
