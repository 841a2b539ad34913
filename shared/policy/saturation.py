"""Scale-out on measured saturation: what a request count tuned for a GPU batch misses on a CPU (pure).

WarmServe's autoscaler (shared/policy/autoscaler.py) counts a model's requests against 0.8 x B per
instance, B a GPU batch (32 there; `[policies] max_batch_size` here, 64 by default). A CPU instance is
saturated long before that: every request it batches slows the others' decode, and requests queue
(measured: 16 running and 19 queued at 17 output tok/s in all, never scaled out). This monitor
measures each model over the autoscaler's window:

* **wait**: requests not running — waiting on its instances plus the dispatchers' queue of it —
  averaged over the window, per serving instance. A queue that does not drain is a queue wait that
  every new request's TTFT pays;
* **pace**: generated tokens/s per running request (the instances' measured `tokens_per_s` over their
  running requests), averaged over the window, against what the TPOT SLO allows: 1 / tpot when it is
  absolute, or the model's best windowed pace divided by k when it is "k x" (the best pace is what an
  unloaded instance showed). Judged only with at least `min_running` requests per instance running.

`verdict` names the saturation (or None). For one window after a model's count of serving
instances changes there is no verdict: the window must first see the new instance take load.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shared.policy.autoscaler import LoadWindow


@dataclass(frozen=True)
class SaturationParams:
    window_s: float = 5.0  # the autoscaler's window
    wait_per_instance: float = 1.0  # requests waiting per serving instance (window mean) that mean saturated
    tpot_s: float | None = None  # an absolute TPOT SLO: pace below 1 / tpot_s is saturated
    tpot_factor: float | None = 5.0  # a relative one ("5x"): pace below the best pace / factor
    min_running: float = 2.0  # pace is judged with at least this many running requests per instance

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.wait_per_instance <= 0 or self.min_running < 1:
            raise ValueError(f"saturation: need window_s > 0, wait_per_instance > 0, min_running >= 1 (got "
                             f"{self.window_s}, {self.wait_per_instance}, {self.min_running})")
        if (self.tpot_s is None) == (self.tpot_factor is None):
            raise ValueError("saturation: give exactly one of tpot_s (absolute) and tpot_factor (relative)")
        if (self.tpot_s is not None and self.tpot_s <= 0) or (self.tpot_factor is not None and self.tpot_factor <= 1):
            raise ValueError(f"saturation: need tpot_s > 0 or tpot_factor > 1 (got {self.tpot_s}, {self.tpot_factor})")


@dataclass(frozen=True)
class InstanceLoad:
    """One serving instance as the stats report it."""

    running: int
    waiting: int
    tokens_per_s: float  # generated over the last stats interval


class _Model:
    __slots__ = ("waits", "paces", "running", "best_pace", "serving", "changed_at")

    def __init__(self, window_s: float, now: float, serving: int) -> None:
        self.waits = LoadWindow(window_s)
        self.paces: deque[tuple[float, float]] = deque()  # (t, tokens/s per running request), running > 0
        self.running: deque[tuple[float, float]] = deque()  # (t, running per instance)
        self.best_pace = 0.0
        self.serving = serving
        self.changed_at = now


def _mean(samples: deque[tuple[float, float]]) -> float:
    return sum(v for _, v in samples) / len(samples) if samples else 0.0


class SaturationMonitor:
    def __init__(self, params: SaturationParams = SaturationParams()) -> None:
        self.p = params
        self.models: dict[str, _Model] = {}

    def observe(self, model: str, now: float, serving: Sequence[InstanceLoad], queued: int) -> None:
        """One sample of `model`: its serving instances' loads and the dispatchers' queue of it."""
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = _Model(self.p.window_s, now, len(serving))
        if len(serving) != m.serving:
            m.serving, m.changed_at = len(serving), now
        m.waits.record(now, sum(i.waiting for i in serving) + queued)
        running = sum(i.running for i in serving)
        if running:
            m.paces.append((now, sum(i.tokens_per_s for i in serving) / running))
            m.running.append((now, running / max(1, len(serving))))
        for samples in (m.paces, m.running):
            while samples and samples[0][0] <= now - self.p.window_s:
                samples.popleft()
        if len(m.paces) >= 2:
            m.best_pace = max(m.best_pace, _mean(m.paces))

    def allowed_pace(self, model: str) -> float | None:
        """The slowest decode pace (tokens/s per request) the TPOT SLO allows; None before any is measured."""
        if self.p.tpot_s is not None:
            return 1.0 / self.p.tpot_s
        m = self.models.get(model)
        if m is None or m.best_pace <= 0:
            return None
        assert self.p.tpot_factor is not None
        return m.best_pace / self.p.tpot_factor

    def verdict(self, model: str, now: float) -> str | None:
        """Why `model` is saturated now (None: it is not, or a change of instances is still settling)."""
        m = self.models.get(model)
        if m is None or m.serving == 0 or now - m.changed_at < self.p.window_s:
            return None
        w = self.p.window_s
        wait = m.waits.mean(now) / m.serving
        if wait >= self.p.wait_per_instance:
            return (f"{wait:.1f} requests waiting per instance (mean over {w:g}s, {m.serving} serving) "
                    f">= {self.p.wait_per_instance:g}")
        allowed = self.allowed_pace(model)
        pace, running = _mean(m.paces), _mean(m.running)
        if allowed is not None and len(m.paces) >= 2 and running >= self.p.min_running and pace < allowed:
            slo = (f"1 / tpot {self.p.tpot_s:g}s" if self.p.tpot_s is not None
                   else f"its best {m.best_pace:.1f} / {self.p.tpot_factor:g}")
            return (f"decode pace {pace:.2f} tok/s per request (mean over {w:g}s, {running:.1f} running per "
                    f"instance) < {allowed:.2f} ({slo})")
        return None

    def forget(self, model: str) -> None:
        self.models.pop(model, None)


__all__ = ["InstanceLoad", "SaturationMonitor", "SaturationParams"]
