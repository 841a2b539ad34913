"""Per cold LoRA request: CPU assist, an asynchronous load or an inline load (CaraServe §4; issue 31).

Pure: no I/O, no clock. The engine (services/gpu_worker/engine/cold_start.py) measures and passes in:

* T_cpu — seconds the prompt's prefill takes with its LoRA on the CPU helpers: its CPU-assisted
  steps at their measured cost (`LinearFit` over those steps: seconds against cold rows x rank), as
  many as its chunks need or until its load lands (ceil(n / c) steps of c tokens at most, at least
  one), then the rest of the prompt on the device;
* X — seconds until the adapter is on the device: the bytes ahead of it on the one link plus its own
  at the measured link rate, which differs for a pageable host copy and a page-locked one
  (`LinkRates`); for a copy already in flight, what is left of it;
* P — seconds of the prompt's prefill on the device (`LinearFit` over the device steps: seconds
  against tokens);
* O — what CPU assist costs the other sequences of the step, summed: while the cold rows are on the
  helpers (until the load lands, or the prompt is through) every step runs at the measured assisted
  rate, not the measured mean step, and each other sequence waits the difference (0 with none);
* the number of other sequences an inline load would stall, and what the asynchronous load costs the
  cold request beyond X (`async_extra_s`: measured, from each async load's landing to the start of
  the step its request then runs in; before any such load, half the measured step).

The rule (`choose`):

1. CPU assist when the helpers are ready, the request has produced no token yet (decoding never runs
   on the helpers), and T_cpu + O < X + P — or when T_cpu is not measured yet, or was last measured
   `PROBE_EVERY` decisions ago (assisting one request is how it is measured again). The assisted
   prefill then beats waiting X for the load and prefilling in P on the device. (Where the helpers'
   x·A·B hides under the device's base projections, as §4 intends, a one-step prompt's T_cpu is
   max(P, its CPU LoRA time), O is 0, and the rule reads: CPU LoRA time < X + P. Where the device
   takes a prompt over inside a step, T_cpu <= X + P always: O is what tells the arms apart.)
2. Otherwise an inline load (the step copies the adapter first, every sequence of the step waits X)
   when the copy cannot run beside the steps at all, or when it is not in flight and stalling the
   others costs less than what the asynchronous load costs the cold request beyond X — waiting for
   the next step boundary after the copy lands, as measured: X x others <= async_extra_s.
   With nothing else running that always holds.
3. Otherwise the asynchronous load: only the cold request waits, its KV kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

CPU_ASSIST, ASYNC, INLINE = "cpu_assist", "async", "inline"
CHOICES = (CPU_ASSIST, ASYNC, INLINE)
PROBE_EVERY = 32  # cold decisions without a T_cpu measurement before one request is assisted to re-measure it
DECAY = 0.9  # weight of the older measurements at each new one (LinearFit, LinkRates)


@dataclass(frozen=True, slots=True)
class ColdCosts:
    """One cold request's measured estimates, seconds (None: not measured yet)."""

    cpu_s: float | None  # T_cpu
    load_s: float  # X
    prefill_s: float | None  # P
    others_s: float = 0.0  # O: what assisting costs the step's other sequences, summed


@dataclass(frozen=True, slots=True)
class ColdSituation:
    helpers_ready: bool  # CPU assist is on and a helper is ready for this adapter
    prefilling: bool  # the request has produced no token yet
    load_beside: bool  # loads can run beside the steps (CUDA, or a paced CPU worker)
    in_flight: bool  # the adapter's copy has already started
    others: int  # sequences of the step an inline load would stall
    async_extra_s: float  # measured wait of an async-loaded request beyond X (landing -> its next step)
    since_cpu: int = 0  # cold decisions since T_cpu was last measured


@dataclass(frozen=True, slots=True)
class Choice:
    kind: str  # one of CHOICES
    reason: str
    costs: ColdCosts


def choose(costs: ColdCosts, at: ColdSituation) -> Choice:
    """The rule above. Unmeasured P counts as 0 (assist must then beat the load alone)."""
    if costs.load_s < 0 or costs.others_s < 0 or at.others < 0 or at.async_extra_s < 0:
        raise ValueError(f"choose: load_s, others and async_extra_s must be >= 0, got {costs.load_s}, {at.others}, "
                         f"{at.async_extra_s}")
    p = costs.prefill_s or 0.0
    if at.helpers_ready and at.prefilling and at.load_beside:
        if costs.cpu_s is None:
            return Choice(CPU_ASSIST, "T_cpu not measured yet: assisting measures it", costs)
        if at.since_cpu >= PROBE_EVERY:
            return Choice(CPU_ASSIST, f"T_cpu last measured {at.since_cpu} cold requests ago: re-measuring", costs)
        o = f" + O {_ms(costs.others_s)}" if costs.others_s else ""
        if costs.cpu_s + costs.others_s < costs.load_s + p:
            return Choice(CPU_ASSIST, f"T_cpu {_ms(costs.cpu_s)}{o} < X {_ms(costs.load_s)} + P {_ms(p)}", costs)
        why = f"T_cpu {_ms(costs.cpu_s)}{o} >= X {_ms(costs.load_s)} + P {_ms(p)}"
    elif not at.load_beside:
        why = "no link to hide"
    else:
        why = "no helper ready" if not at.helpers_ready else "decoding"
    if not at.load_beside:
        return Choice(INLINE, f"{why}: the load runs in the step", costs)
    if not at.in_flight and costs.load_s * at.others <= at.async_extra_s:
        return Choice(INLINE, f"{why}; X {_ms(costs.load_s)} x {at.others} others <= async's wait beyond X "
                              f"{_ms(at.async_extra_s)}", costs)
    return Choice(ASYNC, f"{why}; the load beside the steps" + (" (in flight)" if at.in_flight else ""), costs)


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def chunk_steps(tokens: int, chunk: int) -> int:
    """Steps a prompt of `tokens` takes on the helpers in chunks of `chunk` tokens (0: one step)."""
    if tokens < 0 or chunk < 0:
        raise ValueError(f"chunk_steps: tokens {tokens} and chunk {chunk} must be >= 0")
    return 1 if chunk == 0 or tokens == 0 else math.ceil(tokens / chunk)


class LinearFit:
    """y = a + b x by exponentially weighted least squares (newest weight 1, older ones x DECAY per
    new point); a and b kept >= 0. With one distinct x so far: the line through the origin."""

    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            raise ValueError(f"LinearFit.add: need finite x, y >= 0, got {x}, {y}")
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + x, d * self._y + y
        self._xx, self._xy = d * self._xx + x * x, d * self._xy + x * y
        self.n += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before the first point."""
        if self.n == 0:
            return None
        var = self._xx * self._w - self._x * self._x
        if var > 1e-12 * max(self._xx * self._w, 1e-30):
            b = (self._xy * self._w - self._x * self._y) / var
            a = (self._y - b * self._x) / self._w
            if b >= 0 and a >= 0:
                return a, b
            if b < 0:  # noise: the mean
                return self._y / self._w, 0.0
        b = self._xy / self._xx if self._xx > 0 else 0.0  # through the origin
        return (0.0, b) if self._xx > 0 else (self._y / self._w, 0.0)

    def predict(self, x: float) -> float | None:
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * x


class LinkRates:
    """The link's bytes/s per host copy kind ("pageable" | "page-locked"): a prior (the configured
    pacing, or a probe copy), then an EWMA of completed copies' measured rates."""

    KINDS = ("pageable", "page-locked")

    def __init__(self, prior: dict[str, float] | None = None, decay: float = DECAY) -> None:
        self.decay = decay
        self.rates: dict[str, float] = {}
        for kind, rate in (prior or {}).items():
            self._check(kind, rate)
            self.rates[kind] = rate

    def _check(self, kind: str, rate: float) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"link kind {kind!r}: one of {', '.join(self.KINDS)}")
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"link rate must be finite and > 0 bytes/s, got {rate}")

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self._check(kind, rate)
        old = self.rates.get(kind)
        self.rates[kind] = rate if old is None else self.decay * old + (1 - self.decay) * rate

    def rate(self, kind: str) -> float | None:
        """The kind's rate; an unmeasured kind borrows the other's (a page-locked copy is no slower)."""
        if kind not in self.KINDS:
            raise ValueError(f"link kind {kind!r}: one of {', '.join(self.KINDS)}")
        if kind in self.rates:
            return self.rates[kind]
        other = self.rates.get("pageable" if kind == "page-locked" else "page-locked")
        return other

    def seconds(self, kind: str, nbytes: int) -> float:
        """X for `nbytes` over this link (0 when no rate is known: an unpaced memory copy)."""
        rate = self.rate(kind)
        return nbytes / rate if rate else 0.0


def page_lock_host(device_type: str, cuda_available: bool, setting: bool = True) -> bool:
    """Whether adapters' host copies are page-locked: only for a CUDA engine where CUDA is there,
    and the setting allows (pinned memory is the host's, and only a DMA from it is asynchronous)."""
    return setting and device_type == "cuda" and cuda_available


__all__ = ["ASYNC", "CHOICES", "CPU_ASSIST", "INLINE", "PROBE_EVERY", "Choice", "ColdCosts", "ColdSituation", "LinearFit", "LinkRates",
           "choose", "chunk_steps", "page_lock_host"]
