"""One simulated worker: continuous batching, a per-step token budget, a batch cap and a KV
block budget. Two engine modes (`WorkerSpec.engine_mode`): "chunked" mirrors our engine's
scheduler (services/gpu_worker/engine/scheduler.py): decodes first, then prefill chunks of
admitted requests, then FCFS admission of waiting ones; "vllm-0.6" is the engine the papers'
baselines ran (loadgen/sim/engine_modes.py). In both, when a step needs a KV block and none is
free, the latest-arrived running request is preempted and later recomputed.

Speed: between two changes of the batch (an admission, a finish, a preemption) the batch
decodes identical steps whose time grows linearly with context, so the worker runs them
as ONE event of k steps (closed-form duration), cut short when a request arrives. KV
blocks are counted exactly without touching each request per step: every decoding
request needs a new block when its context is a multiple of the block size, and its
context minus the step counter ("phase", mod block size) never changes while it
decodes, so `phase_count[p]` tells how many requests need a block at each step.
"""
from __future__ import annotations

import math
from bisect import insort
from collections import OrderedDict, deque
from heapq import heappop, heappush

from loadgen.sim.engine_modes import plan_prefill_first
from loadgen.sim.profile import StepCost, WorkerSpec
from loadgen.sim.request import SimRequest
from loadgen.sim.timeline import WorkerTimeline


class SimWorker:
    def __init__(self, index: int, worker_id: str, model: str, spec: WorkerSpec, cost: StepCost,
                 max_run_s: float) -> None:
        self.index = index
        self.worker_id = worker_id
        self.instance_id = f"{worker_id}/{model}"
        self.model = model
        self.spec = spec
        self.cost = cost
        self.max_run_s = max_run_s
        self.c_over, self.c_seq, self.c_ctx = cost.overhead_s, cost.decode_per_seq_s, cost.decode_per_ctx_token_s
        self.bs = spec.block_size
        self.total = spec.kv_blocks
        self.used = 0
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.heap: list[tuple[int, int, int, SimRequest]] = []  # (finish step, order, epoch, request)
        self.decoding = 0  # requests in the decode phase (B)
        self.ctx_sum = 0  # their context tokens (C)
        self.phase_count = [0] * self.bs
        self.step = 0
        self.queued_tokens = 0  # tokens still to prefill, waiting and admitted
        self.adapters: OrderedDict[str, None] = OrderedDict()
        self.adapter_loads = 0
        self.preemptions = 0
        self.steps_run = 0
        self.busy = False
        self.gen = 0  # bumped when the pending step event is replaced
        self.run_start = 0.0
        self.run_k = 0
        self.run_base = 0.0
        self.run_slope = 0.0
        self.run_blocks = 0
        self.run_chunks: list[tuple[SimRequest, int]] | None = None
        self.finished: list[SimRequest] = []  # drained by the simulator after each event
        self.prefill_first = spec.engine_mode == "vllm-0.6"
        self.run_prefill_only = False
        self.blocked_on = "compute"  # why the head of `waiting` was not admitted at the last plan
        self.timeline: WorkerTimeline | None = None  # set by a caller that wants occupancy over time

    # --- arrivals ----------------------------------------------------------------------
    def enqueue(self, req: SimRequest, now: float) -> float | None:
        """Queue a request; returns the time of a new step event if one must be scheduled."""
        req.worker = self.worker_id
        self.waiting.append(req)
        self.queued_tokens += req.to_prefill
        if not self.busy:
            return self.plan(now)
        if self.run_k > 1:
            return self._truncate(now)
        return None

    def _truncate(self, now: float) -> float | None:
        """Cut the running k-step decode run after the step in progress."""
        base, slope, k = self.run_base, self.run_slope, self.run_k
        e = now - self.run_start
        if slope > 0:
            b = base - slope / 2
            j = int((-b + math.sqrt(b * b + 2 * slope * e)) / slope)
        else:
            j = int(e / base)
        j = max(0, min(j, k - 1))
        while j < k - 1 and self._run_time(j + 1) <= e:
            j += 1
        while j > 0 and self._run_time(j) > e:
            j -= 1
        new_k = j + 1
        if new_k >= k:
            return None
        kept = self._crossings(self.step, new_k)
        self.used -= self.run_blocks - kept
        self.run_blocks = kept
        self.run_k = new_k
        self.gen += 1
        return self.run_start + self._run_time(new_k)

    def _run_time(self, k: int) -> float:
        return k * self.run_base + self.run_slope * k * (k - 1) / 2

    # --- KV block arithmetic -------------------------------------------------------------
    def _crossings(self, s: int, k: int) -> int:
        """Blocks the decoding requests need over steps s .. s+k-1."""
        bs = self.bs
        q, r = divmod(k, bs)
        total = q * self.decoding
        cnt = self.phase_count
        for j in range(r):
            total += cnt[-(s + j) % bs]
        return total

    def _decode_run(self, free: int, limit: int) -> tuple[int, int]:
        """The most decode steps k <= limit whose new blocks fit in `free`, and those blocks."""
        bs, b = self.bs, self.decoding
        q = free // b  # whole cycles of bs steps (each needs b blocks) that surely fit
        if q * bs >= limit:
            return limit, self._crossings(self.step, limit)
        k, blocks, rem = q * bs, q * b, free - q * b
        cnt, s = self.phase_count, self.step
        for j in range(min(bs, limit - k)):
            c = cnt[-(s + j) % bs]
            if c > rem:
                break
            rem -= c
            blocks += c
            k += 1
        return k, blocks

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    # --- planning a step -----------------------------------------------------------------
    def plan(self, now: float) -> float | None:
        """At a step boundary: choose the next step (or run of decode steps); returns its end."""
        if self.prefill_first:
            end = plan_prefill_first(self, now)
        else:
            end = self._plan_chunked(now)
        if self.timeline is not None:
            self.timeline.observe(now, self)
        return end

    def _decode_need(self) -> int:
        """Blocks the decoding requests need for the next step."""
        return self.phase_count[-self.step % self.bs] if self.decoding else 0

    def _preempt_for_decode(self, now: float) -> bool:
        """Preempt the latest arrivals until the next decode step's blocks fit; True if any was."""
        preempted = False
        while self._decode_need() > self.total - self.used:
            self._preempt_latest(now)
            preempted = True
        return preempted

    def _plan_chunked(self, now: float) -> float | None:
        """Our engine's step (services/gpu_worker/engine/scheduler.py): decodes first, then
        prefill chunks of admitted requests, then FCFS admission within the token budget."""
        spec, bs = self.spec, self.bs
        preempted = self._preempt_for_decode(now)
        need = self._decode_need()
        free = self.total - self.used - need
        budget = spec.max_batched_tokens - self.decoding
        max_chunk = spec.max_prefill_chunk or budget
        chunks: list[tuple[SimRequest, int, int]] = []  # (request, tokens, blocks reserved)
        extra_s = 0.0
        self.blocked_on = "memory" if preempted else "compute"
        for req in list(self.prefilling) if self.prefilling else ():
            if budget <= 0:
                break
            if req not in self.prefilling:
                continue  # preempted just now
            n = min(req.to_prefill - req.computed, budget, max_chunk)
            nb = self._blocks(req.computed + n) - self._blocks(req.computed)
            while nb > free and req in self.prefilling:
                victim = self._preempt_latest(now)
                preempted = True
                for i, (other, n_o, nb_o) in enumerate(chunks):
                    if other is victim:  # it had a chunk this step: give its tokens and blocks back
                        del chunks[i]
                        self.used -= nb_o
                        budget += n_o
                        break
                need = self._decode_need()
                free = self.total - self.used - need
            if req not in self.prefilling:
                continue
            self.used += nb
            free -= nb
            chunks.append((req, n, nb))
            budget -= n
        if not preempted:
            while self.waiting and budget > 0 and self.decoding + len(self.prefilling) < spec.max_batch:
                req = self.waiting[0]
                if self._blocks(req.to_prefill + 1) > self.total:  # could never fit, even alone
                    self._fail_waiting_head(now)
                    continue
                n = min(req.to_prefill, budget, max_chunk)
                nb = self._blocks(n)
                if nb > free:
                    self.blocked_on = "memory"
                    break  # FCFS: later arrivals do not overtake
                self.waiting.popleft()
                self.prefilling.append(req)
                if req.adapter is not None:
                    extra_s += self._use_adapter(req.adapter)
                self.used += nb
                free -= nb
                chunks.append((req, n, nb))
                budget -= n
        else:
            self.blocked_on = "memory"
        if chunks:
            self.used += need
            self.run_blocks = need
            return self._start_chunks(now, chunks, self.decoding, self.ctx_sum, extra_s)
        return self._plan_decode_run(now, preempted)

    def _fail_waiting_head(self, now: float) -> None:
        req = self.waiting.popleft()
        self.queued_tokens -= req.to_prefill
        self._fail(req, now, f"needs {self._blocks(req.to_prefill + 1)} KV blocks; the worker holds {self.total}")

    def _start_chunks(self, now: float, chunks: list[tuple[SimRequest, int, int]], decode_seqs: int, decode_ctx: int,
                      extra_s: float) -> float:
        """Start one step that prefills `chunks` and decodes `decode_seqs` sequences."""
        ptok = attn = 0
        for req, n, _ in chunks:
            ptok += n
            attn += n * (req.computed + n)
        self.run_k = 1
        self.run_chunks = [(req, n) for req, n, _ in chunks]
        dt = self.cost.step_s(decode_seqs, decode_ctx, ptok, attn) + extra_s + self.extra_step_s(chunks)
        self.busy = True
        self.run_start = now
        self.gen += 1
        return now + dt

    def _plan_decode_run(self, now: float, preempted: bool) -> float | None:
        """A run of identical decode steps up to the next finish (or `max_run_s`); None if idle."""
        if self.decoding:
            heap = self.heap
            while heap[0][2] != heap[0][3].epoch:
                heappop(heap)
            base = self.c_over + self.c_seq * self.decoding + self.c_ctx * self.ctx_sum + self.extra_step_s(())
            limit = heap[0][0] - self.step
            cap = self.max_run_s / base
            if cap < limit:
                limit = max(1, int(cap))
            if preempted and self.waiting:
                limit = 1  # admission was skipped only for this step; the next one may admit
            k, blocks = self._decode_run(self.total - self.used, limit)
            self.run_base = base
            self.run_slope = slope = self.c_ctx * self.decoding
            self.run_blocks = blocks
            self.used += blocks
            self.run_k = k
            self.run_chunks = None
            dt = k * base + slope * k * (k - 1) / 2
        else:
            self.busy = False
            if preempted and self.waiting:
                return self.plan(now)  # everything was preempted: admit afresh (admission skipped above)
            return None
        self.busy = True
        self.run_start = now
        self.gen += 1
        return now + dt

    def extra_step_s(self, chunks) -> float:
        """Seconds a subclass adds to a step (e.g. LoRA kernels, loadgen/sim/lora_worker.py); `chunks`
        are this step's (request, tokens, blocks) prefill chunks, empty for a decode-only step."""
        return 0.0

    # --- finishing a step ----------------------------------------------------------------
    def complete(self, now: float) -> None:
        """The planned step (or run) ended at `now`: advance counters, emit tokens, finish."""
        k, bs = self.run_k, self.bs
        self.steps_run += k
        if self.run_prefill_only:  # vllm-0.6: a prefill step runs no decode token
            self.run_prefill_only = False
            k = 0
        self.ctx_sum += self.decoding * k
        self.step += k
        step = self.step
        heap = self.heap
        while heap and heap[0][0] <= step:
            _, _, epoch, req = heappop(heap)
            if epoch != req.epoch:
                continue
            ctx = req.ctx0 + (step - req.start_step)
            self.decoding -= 1
            self.ctx_sum -= ctx
            self.phase_count[(req.ctx0 - req.start_step) % bs] -= 1
            self.used -= -(-ctx // bs)
            req.generated = req.output
            req.finish = now
            self.finished.append(req)
        chunks = self.run_chunks
        if chunks:
            self.run_chunks = None
            for req, n in chunks:
                req.computed += n
                self.queued_tokens -= n
                if req.computed < req.to_prefill:
                    continue
                self.prefilling.remove(req)
                req.generated += 1
                if req.first_token < 0:
                    req.first_token = now
                if req.generated >= req.output:
                    self.used -= -(-req.computed // bs)
                    req.finish = now
                    self.finished.append(req)
                    continue
                req.ctx0 = req.computed
                req.start_step = step
                req.gen_at_start = req.generated
                self.phase_count[(req.ctx0 - step) % bs] += 1
                self.decoding += 1
                self.ctx_sum += req.ctx0
                heappush(heap, (step + req.output - req.generated, req.order, req.epoch, req))
        self.busy = False

    # --- preemption, failures, adapters --------------------------------------------------
    def _preempt_latest(self, now: float) -> SimRequest:
        live = [e[3] for e in self.heap if e[2] == e[3].epoch]
        victim = max(live + self.prefilling, key=lambda r: r.order)
        bs = self.bs
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            self.used -= self._blocks(victim.computed)
            self.queued_tokens += victim.computed
        else:
            ctx = victim.ctx0 + (self.step - victim.start_step)
            if len(live) + len(self.prefilling) == 1 and self._blocks(ctx + 1) > self.total:
                self._drop_decoding(victim, ctx)
                self._fail(victim, now, f"context {ctx + 1} needs more KV blocks than the worker's {self.total}")
                return victim
            self._drop_decoding(victim, ctx)
            victim.generated = victim.gen_at_start + (self.step - victim.start_step)
            victim.to_prefill = victim.prompt + victim.generated
            self.queued_tokens += victim.to_prefill
        victim.computed = 0
        victim.epoch += 1
        self.preemptions += 1
        self._requeue(victim)
        return victim

    def _drop_decoding(self, req: SimRequest, ctx: int) -> None:
        req.epoch += 1
        self.decoding -= 1
        self.ctx_sum -= ctx
        self.phase_count[(req.ctx0 - req.start_step) % self.bs] -= 1
        self.used -= self._blocks(ctx)

    def _requeue(self, req: SimRequest) -> None:
        if req.status != "ok":
            return
        waiting = list(self.waiting)
        insort(waiting, req, key=lambda r: r.order)
        self.waiting = deque(waiting)

    def _fail(self, req: SimRequest, now: float, message: str) -> None:
        req.status = "error"
        req.error = f"request {req.request_id}: {message}"
        req.finish = now
        self.finished.append(req)

    def _use_adapter(self, name: str) -> float:
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return 0.0
        self.adapters[name] = None
        if len(self.adapters) > self.spec.max_resident_adapters:
            self.adapters.popitem(last=False)
        self.adapter_loads += 1
        return self.spec.adapter_load_s

    # --- invariants (tests) ----------------------------------------------------------------
    def check(self) -> None:
        """Recount blocks and context from scratch; raise if the incremental counters drifted."""
        live = [e[3] for e in self.heap if e[2] == e[3].epoch]
        ctxs = [r.ctx0 + (self.step - r.start_step) for r in live]
        blocks = sum(self._blocks(c) for c in ctxs) + sum(self._blocks(r.computed) for r in self.prefilling)
        assert len(live) == self.decoding, (len(live), self.decoding)
        assert sum(ctxs) == self.ctx_sum, (sum(ctxs), self.ctx_sum)
        assert blocks == self.used, (blocks, self.used)
        assert 0 <= self.used <= self.total, (self.used, self.total)
        assert self.decoding + len(self.prefilling) <= self.spec.max_batch
        pending = sum(r.to_prefill - r.computed for r in self.prefilling) + sum(r.to_prefill for r in self.waiting)
        assert pending == self.queued_tokens, (pending, self.queued_tokens)
