"""The KV-packing fleet's moves (loadgen/sim/kv_packing_fleet.py): a move the policy booked carried out
physically -- Llumnix's pre-copy ("kv") or a re-prefill on the destination ("tokens"), or MELL §V's
adaptive choice between them under the interval's budgets -- landing, handing over or failing.
A mixin of the fleet: it uses the fleet's books and devices."""
from __future__ import annotations

from bisect import insort

from loadgen.sim.kv_packing_fleet_state import INF, QUEUED, RUNNING, Flight
from shared.policy.mell_migration import MigrationCandidate, choose_migration_modes


class FleetMoves:
    def _carry_out(self, now: float, e: int) -> None:
        device_of = self.policy.device_of
        cands: list[tuple[int, str, str]] = []
        for i in sorted(self.mismatch):
            target = device_of(self.ids[i]) if self.st[i] in (RUNNING, QUEUED) else None
            src = self.where[i]
            if target is None or target == src:
                self.mismatch.discard(i)
                continue
            if i in self.flights:
                continue  # it moves on once this copy lands
            if self.st[i] == QUEUED:  # waiting for memory: no KV to carry, it waits there instead
                self._device(src).queue.remove(i)
                insort(self._device(target).queue, i)
                self.where[i] = target
                self.mismatch.discard(i)
                self.requeued += 1
                self._drop_if_empty(src)
                continue
            cands.append((i, src, target))
        if not cands:
            return
        modes = self._choose_modes(cands, now) if self.mode == "auto" else dict.fromkeys(
            (i for i, _, _ in cands), self.mode)
        if self.model is None:  # instant moves: one may make room for another, so try again until none can
            while True:
                fits = [c for c in cands if modes[c[0]] != "defer" and self._room_for(self._device(c[2]), c[0], now)]
                if not fits:
                    break
                for i, src, dst in fits:
                    self.mismatch.discard(i)
                    self._start_copy(i, src, dst, now, e) if modes[i] == "kv" else self._token_move(i, src, dst, now, e)
                cands = [c for c in cands if c not in fits]
        for i, src, dst in cands:
            mode = modes[i]
            if mode == "defer":
                self.deferred += 1
                continue
            self.mismatch.discard(i)
            if i in self.failed_before:
                self.stats.retries += 1
            if not self._room_for(self._device(dst), i, now):
                self._refused(i, src, mode)
            elif mode == "kv":
                self._start_copy(i, src, dst, now, e)
            else:
                self._token_move(i, src, dst, now, e)

    def _choose_modes(self, cands: list[tuple[int, str, str]], now: float) -> dict[int, str]:
        """MELL §V: pack this interval's moves into the interfaces' bytes (KV) and the destinations' spare
        prefill tokens (tokens); what fits neither is deferred."""
        b = self.budgets
        assert b is not None
        E = self.E
        out: dict[str, float] = {}
        inn: dict[str, float] = {}
        pre: dict[str, float] = {}
        cs = [MigrationCandidate(self.ids[i], src, dst, kv_bytes=self._blocks(i, now),
                                 tokens=self.P[i] + self._generated(i, now)) for i, src, dst in cands]
        for c in cs:
            ds, dd = self._device(c.source), self._device(c.destination)
            out[c.source] = b.link_bytes_per_s * max(0.0, E - max(0.0, ds.nic_out - now))
            inn[c.destination] = b.link_bytes_per_s * max(0.0, E - max(0.0, dd.nic_in - now))
            tokens = b.prefill_tokens_per_s * max(0.0, E - max(0.0, dd.prefill_busy - now))
            if dd.prefill_busy <= now and tokens > 0:  # an idle destination takes one re-prefill longer than an
                tokens = max(tokens, c.tokens, pre.get(c.destination, 0.0))  # interval's spare compute (it runs on)
            pre[c.destination] = max(tokens, pre.get(c.destination, 0.0))
        links = {(c.source, c.destination): INF for c in cs}
        choices = choose_migration_modes(cs, links, pre, "auto", egress_budget_bytes=out, ingress_budget_bytes=inn)
        return {self.index[c.request_id]: c.mode for c in choices}

    def _refused(self, i: int, src: str, mode: str) -> None:
        """The destination has no room now: nothing moves."""
        if mode == "kv":
            self.stats.kv_moves += 1
        self.stats.failed["destination full"] += 1
        self.failed_before.add(i)
        if self.revert:
            self.policy.relocate(self.ids[i], src)
        else:
            self.mismatch.add(i)  # MELL's coordinator re-issues it the next interval

    def _start_copy(self, i: int, src: str, dst: str, now: float, e: int) -> None:
        ds, dd = self._device(src), self._device(dst)
        self.stats.kv_moves += 1
        if self.model is None:  # no costs: the hand-over is immediate
            f = Flight(i, src, dst, now, True, 0.0)
            self.flights[i] = f
            ds.out.add(i)
            dd.incoming.add(i)
            dd.ub += self.ubs[i]
            self._hand_over(f, now, e)
            return
        nbytes = self._blocks(i, now)
        pc = self.model.precopy(nbytes)
        start = max(now, ds.nic_out, dd.nic_in)  # one copy at a time per interface and direction
        if pc.ok:
            f = Flight(i, src, dst, start + pc.total_s, True, pc.stall_s)
            self.copy_cost[i] = (pc.total_s, pc.blocks * self.model.block_size * self.bpt)
        else:
            f = Flight(i, src, dst, start + pc.precopy_s, False, 0.0, "did not converge")
        ds.nic_out = dd.nic_in = f.done_s
        self.flights[i] = f
        ds.out.add(i)
        dd.incoming.add(i)
        dd.ub += self.ubs[i]

    def _land(self, now: float, e: int) -> None:
        """Copies whose hand-over (or failure) time has come."""
        if not self.flights:
            return
        for f in sorted((f for f in self.flights.values() if f.done_s <= now), key=lambda f: (f.done_s, f.request)):
            if not f.ok:
                self._fail(f, f.reason, put_back=True)
            elif self._end(f.request) < f.done_s:
                self._fail(f, "request ended", put_back=True)
            else:
                self._hand_over(f, now, e)

    def _hand_over(self, f: Flight, now: float, e: int) -> None:
        i = f.request
        del self.flights[i]
        ds, dd = self._device(f.source), self._device(f.destination)
        ds.out.discard(i)
        ds.running.discard(i)
        ds.ub -= self.ubs[i]
        dd.incoming.discard(i)
        dd.running.add(i)
        self.where[i] = f.destination
        st = self.stats
        st.kv_ok += 1
        copy_s, nbytes = self.copy_cost.pop(i, (0.0, 0))
        st.copy_s += copy_s
        st.bytes_copied += nbytes
        self.failed_before.discard(i)
        if f.stall_s > 0:
            st.stalls.append(f.stall_s)
            st.delay[self.ids[i]] = st.delay.get(self.ids[i], 0.0) + f.stall_s
            self._shift(i, self.TF[i] + f.stall_s, e, started=self._generated(i, f.done_s) > 0)
        if self.policy.device_of(self.ids[i]) != f.destination:
            self.mismatch.add(i)  # the books moved it on meanwhile
        self._drop_if_empty(f.source)

    def _fail(self, f: Flight, reason: str, *, put_back: bool) -> None:
        """A copy that ends without a hand-over: the destination's reservation is freed, the request is
        where it was."""
        i = f.request
        del self.flights[i]
        self.copy_cost.pop(i, None)
        ds, dd = self._device(f.source), self._device(f.destination)
        ds.out.discard(i)
        dd.incoming.discard(i)
        dd.ub -= self.ubs[i]
        self.stats.failed[reason] += 1
        self.failed_before.add(i)
        if put_back:
            if not self.revert:
                self.mismatch.add(i)  # retried the next interval
            elif self.policy.device_of(self.ids[i]) == f.destination:
                self.policy.relocate(self.ids[i], f.source)
        self._drop_if_empty(f.destination)

    def _token_move(self, i: int, src: str, dst: str, now: float, e: int) -> None:
        """Token mode: the source drops the KV at once, the destination re-prefills the context."""
        ds, dd = self._device(src), self._device(dst)
        g = self._generated(i, now)
        tokens = max(self.base[i], self.P[i] + g)
        r = self._reprefill_s(tokens)
        self.base[i] = tokens
        ds.running.discard(i)
        ds.ub -= self.ubs[i]
        dd.running.add(i)
        dd.ub += self.ubs[i]
        self.where[i] = dst
        dd.prefill_busy = max(dd.prefill_busy, now) + r
        st = self.stats
        st.token_moves += 1
        st.recompute_s += r
        st.delay[self.ids[i]] = st.delay.get(self.ids[i], 0.0) + r
        self.failed_before.discard(i)
        self._shift(i, max(self.TF[i], self._resume_tf(now, g, tokens)), e, started=g > 0)
        self._drop_if_empty(src)


__all__ = ["FleetMoves"]
