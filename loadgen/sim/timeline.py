"""What a simulated worker's engine looked like over time: KV occupancy, preemptions, and the
waiting queue split by what it waits for.

"Waiting for memory": the head of the queue was not admitted because its KV blocks did not fit
(or the step had to preempt); "waiting for compute": the step's token budget or the batch cap
was full. The whole queue is counted under its head's reason (FCFS: nobody overtakes the head).
Samples are taken at step boundaries, at most one per `interval_s` of simulated time, plus every
change of the preemption count, so a recompute storm is never smoothed away.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from loadgen.sim.worker import SimWorker


class OccupancySample(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    t_s: float
    kv_used: float  # fraction of the worker's KV blocks in use
    running: int  # requests decoding or prefilling
    waiting_memory: int
    waiting_compute: int
    preemptions: int  # cumulative


class WorkerTimeline:
    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[OccupancySample] = []
        self._next = 0.0
        self._preemptions = 0
        self.kv_peak = 0.0

    def observe(self, now: float, w: SimWorker) -> None:
        used = w.used / w.total if w.total else 0.0
        if used > self.kv_peak:
            self.kv_peak = used
        if now < self._next and w.preemptions == self._preemptions:
            return
        self._next = now + self.interval_s
        self._preemptions = w.preemptions
        waiting = len(w.waiting)
        memory = waiting if w.blocked_on == "memory" else 0
        self.samples.append(OccupancySample(t_s=now, kv_used=used, running=w.decoding + len(w.prefilling),
                                            waiting_memory=memory, waiting_compute=waiting - memory,
                                            preemptions=w.preemptions))


__all__ = ["ClusterSample", "OccupancySample", "WorkerTimeline", "sample_workers"]


class ClusterSample(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A cluster of workers at one instant (loadgen/sim/buddy_cluster.py samples it)."""

    t_s: float
    kv_used: float  # the cluster's KV blocks in use, as a fraction of all of them
    kv_used_max: float  # the fullest instance's fraction
    demand: float  # KV in use plus the queued prompts' KV, as a fraction of all blocks (Llumnix's demand)
    waiting_memory: int
    waiting_compute: int
    preemptions: int  # cumulative
    # KV in use plus each worker's head-of-line queued prompt, as a fraction of all blocks: the demand
    # Llumnix (and KunServe §2.2, "in-processing requests and head-of-line queuing requests") counts
    demand_hol: float = 0.0


def sample_workers(t: float, workers: list, preemptions: int) -> ClusterSample:
    """One ClusterSample of `workers` (SimWorkers) at `t`."""
    used = total = queued = head = mem = comp = 0
    peak = 0.0
    for w in workers:
        used += w.used
        total += w.total
        queued += -(-w.queued_tokens // w.bs)
        if w.waiting:
            head += -(-w.waiting[0].to_prefill // w.bs)
        peak = max(peak, w.used / w.total) if w.total else peak
        n = len(w.waiting)
        if w.blocked_on == "memory":
            mem += n
        else:
            comp += n
    total = total or 1
    return ClusterSample(t_s=t, kv_used=used / total, kv_used_max=peak, demand=(used + queued) / total,
                         waiting_memory=mem, waiting_compute=comp, preemptions=preemptions,
                         demand_hol=(used + head) / total)
