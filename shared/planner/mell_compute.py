"""MELL's compute boundary, live: a move's destination must keep decoding within the TPOT SLO (pure).

MELL packs requests by KV bytes. Its bins are GPUs that must also keep serving at the SLO (the paper,
and `tidal repro mell`, judge every packing at a TPOT target), and on a GPU's memory-bound decode a
step barely grows with the batch, so packing by bytes keeps that. On a compute-bound worker (a CPU,
or a GPU at a large batch) every request added slows every step: packing by bytes alone moved every
request of the default cluster from cpu-1 to cpu-0 (issue 35: cpu-0 at 12 running and a 548 ms TPOT,
cpu-1 idle). So a move onto worker `d` is made only when d's projected decode step for the model,
with the moved requests, stays within the SLO:

    projected = (running + waiting + arriving + k) x u,   u = 1 / tokens_per_s of d's instance

`u` is the seconds of step per generated token over d's last stats interval (each running request
gets one token a step, so the step is running x u); `arriving` counts this policy's moves onto d
decided or applied and not yet in its stats; `k` the moves onto d admitted before this one in the
same interval (pressure moves first). The projection is the compute-bound one: the step grows in
proportion to the batch, no fixed part. Where batching is cheap (a GPU, a CPU's shared weight reads)
it over-estimates, so a move it allows keeps the SLO. A destination with no measured decode (no
running request, or no token in its last interval) takes the slowest `u` any worker shows for the
model.

The SLO: `[slo] tpot` absolute (`tpot_s`), or "k x" (`factor`): k times the model's best steady step
seen, the smallest running x u of an instance whose running count had not changed since its
previous stats and that had no prompt left to prefill in either (an unloaded instance's TPOT; a sample
right after requests ended or arrived would mix two batch sizes, and one spent prefilling emits almost
no token: on the default cluster the first sample, a 956-token prefill, read a 57 s "step" and let a
5x SLO of 285 s through). Until a model's decode is measured (and, relative, its best step), a
consolidation (`fragmentation`) move waits: it is worth making only when the SLO is shown to hold.
A KV-pressure move (its source above the watermark) goes then: relief before the source preempts.
With a measurement both kinds go only where the projection is within the SLO.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from shared.planner.view import ClusterView, InstanceView
from shared.policy.mell_migration import MigrationCandidate


@dataclass(frozen=True, slots=True)
class TpotSlo:
    """The decode SLO the gate holds destinations to: exactly one of an absolute TPOT and a factor."""

    tpot_s: float | None = None
    factor: float | None = None

    def __post_init__(self) -> None:
        if (self.tpot_s is None) == (self.factor is None):
            raise ValueError("TpotSlo: give exactly one of tpot_s (absolute) and factor (relative)")
        if (self.tpot_s is not None and self.tpot_s <= 0) or (self.factor is not None and self.factor <= 0):
            raise ValueError(f"TpotSlo: need tpot_s > 0 or factor > 0 (got {self.tpot_s}, {self.factor})")


@dataclass(frozen=True, slots=True)
class Verdict:
    candidate: MigrationCandidate
    model: str
    hot: bool  # a KV-pressure move (its source above the watermark)
    ok: bool
    note: str  # why it goes or waits (the effect's reason, or the skip's)


def per_token_s(inst: InstanceView | None) -> float | None:
    """Seconds of decode step per generated token on an instance, None when it decoded nothing."""
    if inst is None or inst.running <= 0 or inst.tokens_per_s <= 0:
        return None
    return 1.0 / inst.tokens_per_s


class ComputeGate:
    def __init__(self, slo: TpotSlo) -> None:
        self.slo = slo
        self.best_step: dict[str, float] = {}  # model -> its smallest steady step seen (relative SLO)
        self._sample: dict[str, tuple[float, int, bool]] = {}  # instance -> (stats ts, running, prefilling)

    def observe(self, view: ClusterView) -> None:
        """Take each instance's new stats: a steady one (same running as its previous stats) may lower the
        model's best step."""
        seen = set()
        for worker in view.workers.values():
            for inst in worker.instances:
                seen.add(inst.instance_id)
                before = self._sample.get(inst.instance_id)
                if before is not None and before[0] == worker.stats_ts:
                    continue  # the same stats again: no new sample
                prefilling = inst.waiting > 0 or inst.queued_prompt_tokens > 0
                self._sample[inst.instance_id] = (worker.stats_ts, inst.running, prefilling)
                u = per_token_s(inst)
                if u is None or before is None or before[1] != inst.running or before[2] or prefilling:
                    continue  # not a steady decode: the batch changed, or a prompt's prefill took the steps
                step = inst.running * u
                best = self.best_step.get(inst.model)
                self.best_step[inst.model] = step if best is None else min(best, step)
        for gone in set(self._sample) - seen:
            del self._sample[gone]

    def slo_step(self, model: str) -> float | None:
        """The longest decode step the SLO allows for `model`; None while a relative one has no base."""
        if self.slo.tpot_s is not None:
            return self.slo.tpot_s
        best = self.best_step.get(model)
        return None if best is None else self.slo.factor * best  # type: ignore[operator]

    def slo_text(self, model: str) -> str:
        if self.slo.tpot_s is not None:
            return f"SLO {self.slo.tpot_s:.3g}s"
        return f"SLO {self.slo_step(model):.3g}s = {self.slo.factor:g}x best {self.best_step[model]:.3g}s"

    def judge(self, view: ClusterView, moves: Sequence[tuple[MigrationCandidate, str, bool]],
              arriving: Counter[tuple[str, str]]) -> list[Verdict]:
        """Each move (candidate, model, hot), in order: whether its destination keeps the SLO with it and the
        moves admitted before it (arriving: (worker, model) -> moves onto it already on their way)."""
        admitted: Counter[tuple[str, str]] = Counter()
        out = []
        for cand, model, hot in moves:
            dest = cand.destination
            limit = self.slo_step(model)
            inst = view.workers[dest].instance_of(model) if dest in view.workers else None
            u = per_token_s(inst)
            measured_here = u is not None
            if u is None:  # the slowest decode the model shows elsewhere
                known = [x for w in view.workers.values() if (x := per_token_s(w.instance_of(model))) is not None]
                u = max(known) if known else None
            if limit is None or u is None or inst is None:
                what = "no decode measured" if u is None or inst is None else "the SLO's base not measured yet"
                out.append(Verdict(cand, model, hot, hot, f"{what} for {model}: " + (
                    "KV relief goes unjudged" if hot else f"consolidation onto {dest} waits")))
                continue
            before = inst.running + inst.waiting + arriving[(dest, model)] + admitted[(dest, model)]
            projected = (before + 1) * u
            basis = "" if measured_here else " (u from the model's slowest worker)"
            if projected <= limit:
                admitted[(dest, model)] += 1
                out.append(Verdict(cand, model, hot, True, f"{dest}'s decode step {before * u:.3g}s -> "
                                   f"{projected:.3g}s with it{basis} <= {self.slo_text(model)}"))
            else:
                out.append(Verdict(cand, model, hot, False, f"{dest}'s decode step would be {projected:.3g}s with "
                                   f"{before + 1} requests{basis} > {self.slo_text(model)}: stays on {cand.source}"))
        return out


__all__ = ["ComputeGate", "TpotSlo", "Verdict", "per_token_s"]
