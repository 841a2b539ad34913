"""The KV-packing fleet's engines (loadgen/sim/kv_packing_fleet.py): what requests do on a device --
granules growing, departures, vLLM 0.6's preemption of the newest when the blocks exceed C, and
first-come-first-served admission while the queue's head fits. A mixin of the fleet."""
from __future__ import annotations

from bisect import insort

from loadgen.sim.kv_packing_fleet_state import DONE, QUEUED, RUNNING, Device


class FleetEngine:
    def _resize(self, i: int, new: int) -> None:
        delta = new - self.size[i]
        self.size[i] = new
        self.live_bytes += delta
        self.book_bytes += delta
        ub = self._ub_bytes(new)
        ub_delta, self.ubs[i] = ub - self.ubs[i], ub
        self._device(self.where[i]).ub += ub_delta
        f = self.flights.get(i)
        if f is not None:
            self._device(f.destination).ub += ub_delta

    def _ub_bytes(self, granule_bytes: int) -> int:
        """A granule in whole blocks: what a request holding at most that many tokens can hold in blocks."""
        tokens = granule_bytes // self.bpt
        return min(-(-tokens // self.blk) * self.blk, self.cap_tok) * self.bpt

    def _depart(self, i: int, now: float) -> None:
        f = self.flights.get(i)
        if f is not None:
            self._fail(f, "request ended", put_back=False)
        d = self._device(self.where[i])
        d.running.discard(i)
        d.ub -= self.ubs[i]
        self.live_bytes -= self.size[i]
        self.book_bytes -= self.size[i]
        self.st[i] = DONE
        self.mismatch.discard(i)
        self.failed_before.discard(i)
        self._drop_if_empty(self.where[i])

    def _preempt(self, i: int, now: float) -> None:
        f = self.flights.get(i)
        if f is not None:
            self._fail(f, "preempted on the source", put_back=True)
        d = self._device(self.where[i])
        self.frozen[i] = max(self.base[i], self.P[i] + self._generated(i, now)) - self.P[i]
        self.was_preempted[i] = True
        d.running.discard(i)
        d.ub -= self.ubs[i]
        self.live_bytes -= self.size[i]
        self.st[i] = QUEUED
        self.qsince[i] = now
        self.ver[i] += 1  # no departure or growth while it waits
        insort(d.queue, i)
        self.preemptions += 1

    def _admit(self, i: int, d: Device, now: float, e: int) -> None:
        d.running.add(i)
        d.ub += self.ubs[i]
        self.live_bytes += self.size[i]
        self.st[i] = RUNNING
        if self.was_preempted[i]:  # recompute: prompt + what it had generated, then its next token
            g = self.frozen[i]
            self.frozen[i] = 0
            self.base[i] = self.P[i] + g
            self.was_preempted[i] = False
            self._shift(i, max(self.TF[i], self._resume_tf(now, g, self.P[i] + g)), e, started=g > 0)
        else:
            self.frozen[i] = 0
            if now > self.qsince[i]:  # an arrival held back: it starts as late as it waited
                self.held_back += 1
                self._shift(i, self.TF[i] + (now - self.qsince[i]), e, started=False)
            else:
                self._schedule_events(i, e)

    def _enforce(self, now: float, e: int) -> None:
        """Preempt what outgrew a device (newest first), then admit its waiting requests (FCFS)."""
        C = self.C
        for dev in list(self.dev.values()):
            held = -1
            if dev.ub > C:
                held = self._held_exact(dev, now)
                if held > C:
                    for i in sorted(dev.running, key=lambda i: (i in dev.out, -i)):
                        if held <= C:
                            break
                        held -= self._blocks(i, now)
                        self._preempt(i, now)
            if dev.queue:
                exact = held >= 0
                free = C - (held if exact else dev.ub)
                while dev.queue:
                    i = dev.queue[0]
                    need = self._blocks(i, now)
                    if need > free and not exact:  # the granules said no: ask the blocks
                        free = C - self._held_exact(dev, now)
                        exact = True
                    if need > free:
                        break
                    dev.queue.pop(0)
                    free -= need
                    self._admit(i, dev, now, e)


__all__ = ["FleetEngine"]
