"""What the cold-start rule is fed (shared/policy/lora_cold_choice.py), measured in this engine.

* P: every step without CPU-assisted chunks or an inline load: seconds against the step's tokens
  (a linear fit: a fixed part — the weights read — plus a per-token part);
* T_cpu: the prompt's prefill with its LoRA on the helpers, from every CPU-assisted step: the step's
  seconds against its cold rows x rank (a linear fit: the helper round trips of every layer and the
  device's share of the step in the fixed part, the helpers' x·A·B in the slope). A prompt of n
  tokens in chunks of c runs ceil(n / c) such steps, or fewer when its load lands first — k =
  ceil(X / step) steps (at least one), the device taking over for the rest, P(n - k c). Measured
  whole, the assisted step carries what the overlap of §4 does not hide on this machine (the
  engine's core waiting per layer, the batch that shares the step);
* X: the link's measured rate per host copy kind, from every landed copy (prior: the worker's
  pacing, or a probe copy on CUDA), over the bytes on the link ahead of the load and its own.

It also keeps what was chosen: counts per choice (a request's first decision), the decision of
each recent request (`trace`: the request's trace) and the last one, for stats and the bench.
"""
from __future__ import annotations

import math
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
        self.since_cpu = 0  # cold decisions since T_cpu was last measured
        self.counts = {c: 0 for c in CHOICES}
        self.trace: OrderedDict[str, Choice] = OrderedDict()
        self.last: Choice | None = None

    # --- estimates -----------------------------------------------------------------------
    def cpu_s(self, tokens: int, rank: int, load_s: float | None = None) -> float | None:
        """T_cpu for a prompt of `tokens` at `rank` (its load landing after `load_s`: the device takes
        over at the step after); None before any CPU-assisted step was measured."""
        ab = self.cpu.coefficients()
        if ab is None:
            return None
        chunk = self.cpu_chunk or max(tokens, 1)
        step = ab[0] + ab[1] * min(chunk, tokens) * max(rank, 1)
        steps = chunk_steps(tokens, self.cpu_chunk)
        if load_s is not None and step > 0:
            steps = min(steps, max(1, math.ceil(load_s / step)))
        rest = max(0, tokens - steps * chunk)
        return steps * step + ((self.prefill_s(rest) or 0.0) if rest else 0.0)

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
        return {"choices": dict(self.counts), "step_s": self.step_s, "prefill_fit": self.prefill.coefficients(),
                "cpu_fit": self.cpu.coefficients(), "link_bytes_per_s": rates,
                "last": None if self.last is None else {"kind": self.last.kind, "reason": self.last.reason}}


__all__ = ["ColdCostModel"]
