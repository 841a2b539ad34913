"""What the cold-start rule is fed (shared/policy/lora_cold_choice.py), measured in this engine.

* P: every step without CPU-assisted chunks or an inline load: seconds against the step's tokens
  (a linear fit: a fixed part — the weights read — plus a per-token part);
* T_cpu: the prompt's prefill with its LoRA on the helpers, from every CPU-assisted step: the step's
  seconds against its cold rows x rank (a linear fit: the helper round trips of every layer and the
  device's share of the step in the fixed part, the helpers' x·A·B in the slope). A prompt of n
  tokens in chunks of c runs ceil(n / c) such steps when they end before its load lands; else the
  device takes over at the layer boundary after X, inside the step, and does the rest of the prompt:
  T_cpu = X + (1 - done) P(n), done = the share of the prompt the assisted steps got through by X
  (c X / step / n). (So T_cpu < X + P whenever P > 0: with the takeover inside a step, starting on
  the helpers never delays the cold request itself; what it costs the batch is not in the rule.) Measured
  whole, the assisted step carries what the overlap of §4 does not hide on this machine (the
  engine's core waiting per layer, the batch that shares the step);
* X: the link's measured rate per host copy kind, from every landed copy — beside the steps or
  inline (prior: the worker's pacing, or a probe copy on CUDA), over the bytes on the link ahead of
  the load and its own;
* O, what assisting costs the step's other sequences: while the cold rows are on the helpers
  (until X, or the prompt is through) each step runs at the assisted rate (the T_cpu line) instead
  of the mean step, and each other sequence waits the difference: others x busy x (1 - mean / assisted);
* async's wait beyond X (the inline branch's other side): from each asynchronous load's landing to
  the start of the step its waiting requests then run in (an EWMA; before the first, half the
  measured mean step — a copy landing at a uniform point of a step).

It also keeps what was chosen: counts per choice (a request's first decision), the decision of
each recent request (`trace`: the request's trace) and the last one, for stats and the bench.
"""
from __future__ import annotations

from collections import OrderedDict

from shared.policy.lora_cold_choice import CHOICES, Choice, LinearFit, LinkRates, chunk_steps

STEP_EWMA = 0.2  # weight of the newest step time in the mean step time
TRACE = 1024  # requests whose decision is kept


class ColdCostModel:
    def __init__(self, cpu_chunk: int, prior_rates: dict[str, float] | None = None) -> None:
        self.cpu_chunk = cpu_chunk
        self.prefill = LinearFit()
        self.cpu = LinearFit()
        self.links = LinkRates(prior_rates)
        self.step_s = 0.0
        self.async_extra = None  # EWMA of async loads' landing-to-next-step waits (None: none measured)
        self.since_cpu = 0  # cold decisions since T_cpu was last measured
        self.counts = {c: 0 for c in CHOICES}
        self.trace: OrderedDict[str, Choice] = OrderedDict()
        self.last: Choice | None = None

    # --- estimates -----------------------------------------------------------------------
    def cpu_s(self, tokens: int, rank: int, load_s: float | None = None) -> float | None:
        """T_cpu for a prompt of `tokens` at `rank`, its load landing after `load_s`; None before any
        CPU-assisted step was measured. The device takes over at the first layer boundary after the load
        lands, inside the step (cpu_lora_batch.py): the helpers' path gets through the prompt at its
        measured step rate until then, the device does the rest — its share of P. A chunk is left whole
        when the load lands within its assisted step (cold_start.py), as here."""
        shape = self._assisted_chunk(tokens, rank, load_s)
        if shape is None:
            return None
        chunk, step = shape
        on_cpu = chunk_steps(tokens, chunk) * step  # every chunk on the helpers
        if load_s is None or load_s >= on_cpu or step <= 0:
            return on_cpu
        done = min(1.0, chunk * load_s / step / max(tokens, 1))  # the prompt's share through when it lands
        return load_s + (1.0 - done) * (self.prefill_s(tokens) or 0.0)

    def _assisted_chunk(self, tokens: int, rank: int, load_s: float | None) -> tuple[int, float] | None:
        """(tokens of each assisted step, its measured seconds): the whole prompt when it is one chunk or
        its load lands within the whole prompt's step (it is then not cut), else `cpu_chunk`."""
        ab = self.cpu.coefficients()
        if ab is None:
            return None
        whole = ab[0] + ab[1] * max(tokens, 1) * max(rank, 1)
        if self.cpu_chunk == 0 or tokens <= self.cpu_chunk or (load_s is not None and load_s < whole):
            return max(tokens, 1), whole
        return self.cpu_chunk, ab[0] + ab[1] * self.cpu_chunk * max(rank, 1)

    def others_s(self, tokens: int, rank: int, load_s: float, others: int) -> float:
        """O: what assisting this prompt costs the step's `others` sequences, summed — while its rows are
        on the helpers (until the load lands, or the prompt is through), each step runs at the measured
        assisted rate instead of the measured mean step; each other sequence waits the difference."""
        shape = self._assisted_chunk(tokens, rank, load_s)
        if shape is None or others <= 0 or self.step_s <= 0:
            return 0.0
        chunk, step = shape
        if step <= self.step_s:
            return 0.0
        busy = min(load_s, chunk_steps(tokens, chunk) * step)
        return others * busy * (1.0 - self.step_s / step)

    def prefill_s(self, tokens: int) -> float | None:
        return self.prefill.predict(tokens)

    def load_s(self, name: str, nbytes: int, kind: str, queue: list[tuple[str, int, str]], elapsed: float) -> float:
        """X: the copies ahead of `name` on the link (and its own; `queue`: name, bytes, kind in link
        order, the first one on the link for `elapsed` seconds), or what is left of them."""
        total, found = 0.0, False
        for n, b, k in queue:
            total += self.links.seconds(k, b)
            if n == name:
                found = True
                break
        if not found:
            total += self.links.seconds(kind, nbytes)
        return max(0.0, total - (elapsed if queue else 0.0))

    # --- measurements --------------------------------------------------------------------
    def observe_step(self, tokens: int, seconds: float, cpu_work: int = 0, inline: bool = False) -> None:
        """A step of `tokens` took `seconds`; `cpu_work`: its cold rows x rank on the helpers (0: none)."""
        if seconds <= 0 or tokens <= 0:
            return
        self.step_s = seconds if self.step_s == 0 else (1 - STEP_EWMA) * self.step_s + STEP_EWMA * seconds
        if cpu_work > 0:
            self.cpu.add(cpu_work, seconds)
            self.since_cpu = 0
        elif not inline:
            self.prefill.add(tokens, seconds)

    def observe_load(self, kind: str, nbytes: int, seconds: float) -> None:
        self.links.add(kind, nbytes, seconds)

    def observe_async_wait(self, seconds: float) -> None:
        """An asynchronous load's requests waited `seconds` from its landing to their next step."""
        if seconds < 0 or seconds != seconds:
            raise ValueError(f"async wait must be >= 0 s, got {seconds}")
        old = self.async_extra
        self.async_extra = seconds if old is None else (1 - STEP_EWMA) * old + STEP_EWMA * seconds

    def async_extra_s(self) -> float:
        """What an asynchronous load costs its request beyond X: measured, else half the mean step."""
        return self.async_extra if self.async_extra is not None else self.step_s / 2

    def record(self, seq_id: str, choice: Choice) -> None:
        """A request's decision: counted once (its first), traced (its latest)."""
        if seq_id not in self.trace:
            self.counts[choice.kind] += 1
            self.since_cpu += 1
        self.trace[seq_id] = choice
        self.trace.move_to_end(seq_id)
        while len(self.trace) > TRACE:
            self.trace.popitem(last=False)
        self.last = choice

    def summary(self) -> dict:
        """The counts and the fitted inputs (for stats, logs and the bench)."""
        rates = {k: r for k in LinkRates.KINDS if (r := self.links.rates.get(k))}
        return {"choices": dict(self.counts), "step_s": self.step_s, "async_extra_s": self.async_extra_s(),
                "async_extra_measured": self.async_extra is not None, "prefill_fit": self.prefill.coefficients(),
                "cpu_fit": self.cpu.coefficients(), "link_bytes_per_s": rates,
                "last": None if self.last is None else {"kind": self.last.kind, "reason": self.last.reason}}


__all__ = ["ColdCostModel"]
