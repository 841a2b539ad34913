"""Requests whose adapter is not on the device (CaraServe §4): load it, and meanwhile prefill on CPU.

Each step (`route`, before the runner): landed loads become resident — this is the chunk
boundary where the device path takes over. For every chunk whose adapter is still cold the
adapter's load is started (paced, `lora_loads`), then:

* a prefill chunk (the request has produced no token yet) goes to the CPU helpers
  (`lora_on_cpu`) when assist is on and a helper is ready: the prefill starts at once;
* any other chunk — decoding, assist off, no helper, or a request whose helper failed — sits
  the step out, keeping its KV, until the load lands (our asynchronous load without assist).

A CPU-assisted chunk is cut to `cpu_chunk` tokens (the rest of the prompt waits for the next
step), so a prompt runs in chunks while its adapter loads and the first chunk after the load
lands runs on the device: the device takes over mid-prefill, not only at the next request.
Inside a step the device takes over too (issue 31): at every layer boundary of a CPU-assisted
step the hook (cpu_lora_batch.py) asks `_land` whether the load landed; if it did, the adapter is
made resident there and its rows take the device path for the remaining layers of the same step
(`mid_step_takeovers`). So a chunk is not cut when its load is expected to land within the step
the whole chunk would take on the helpers (X < the measured assisted step: `uncut`): the prompt
then needs one step, not ceil(n / cpu_chunk).

`load_mode="inline"` is the paper's OnDemand (LightLLM, S-LoRA): the step that needs a cold
adapter loads it first, and the whole batch waits for the copy (paced on a CPU worker).

`load_mode="auto"` (the worker's) decides per cold request instead of by a fixed mode: CPU assist,
the asynchronous load or an inline load, by shared/policy/lora_cold_choice.py's rule (assist when
T_cpu < X + P) on what this engine measured (cold_costs.py: P from its device steps, T_cpu from
its CPU-assisted steps, X from its landed copies at the link's rate for a pageable or page-locked
host copy). Every decision is counted and kept per request (`costs.counts`, `costs.trace`); the
fixed modes record theirs too. On CUDA the host copies are page-locked (lora_page_lock.py).

The helpers see every adapter from its registration: with assist on, the worker's host copies
live in shared files (`LoRAManager.share_host`) and each one is announced to the helpers when it
is registered (or when they start), so no helper reads an adapter file on the request path.

When the helpers fail during a step (`fall_back`), the CPU chunks are removed, their requests
wait for the load from then on (never a token from half-computed deltas), and the step runs
again without them: every KV write is at the same positions, so re-running is exact.

Loads run beside the steps only where there is something to hide: on CUDA, or when the worker
paces its loads (`lora_load_bandwidth`). A CPU worker without pacing loads in the step, as
before (a memory copy), and starts no helpers.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence as Seq

from shared.policy.lora_cold_choice import ASYNC, CPU_ASSIST, INLINE, Choice, ColdCosts, ColdSituation, choose, \
    page_lock_host

from .batch import ScheduledChunk, SchedulerOutput
from .cold_costs import ColdCostModel
from .cpu_lora_helpers import CpuLoRAFailed, CpuLoRAHelpers
from .lora_loads import AdapterLoads, paced_seconds, probe_link
from .lora_shared import SharedLayout
from .model_runner import ModelRunner
from .sequence import Sequence

LOAD_MODES = ("auto", "async", "inline")
CPU_CHUNK = 32  # tokens of a CPU-assisted prefill chunk: the device takes over at the next one


class ColdStart:
    def __init__(self, runner: ModelRunner, *, assist: bool, processes: int, bandwidth: float | None,
                 model_dir: str, dtype: str | None, max_rows: int, load_mode: str = "async",
                 cpu_chunk: int = CPU_CHUNK, cores: Seq[int] = (), page_lock: bool = True, cpu_pace: float = 0.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if load_mode not in LOAD_MODES:
            raise ValueError(f"lora load mode {load_mode!r}: one of {', '.join(LOAD_MODES)}")
        if cpu_chunk < 0:
            raise ValueError(f"cpu_chunk must be >= 0 (0: whole prompts), got {cpu_chunk}")
        paced_seconds(1, bandwidth)  # refuse a bad bandwidth now
        self.runner = runner
        self.lora = runner.lora
        self.load_mode = load_mode
        self.bandwidth = bandwidth
        beside = load_mode != "inline" and (bandwidth is not None or runner.device.type == "cuda")
        self.assist = assist and processes > 0 and beside
        self.processes = processes
        self.cpu_chunk = cpu_chunk
        self.cores = tuple(cores)
        self.cpu_pace = cpu_pace
        self.loads = AdapterLoads(self.lora, bandwidth) if beside else None
        import torch

        locks = self.lora.page_locks
        locks.enabled = page_lock_host(runner.device.type, torch.cuda.is_available(), page_lock)
        if self.loads is not None:
            locks.busy = self.loads.loading
            self.loads.kind_of = locks.kind
        self.costs = ColdCostModel(cpu_chunk, _prior_rates(runner, bandwidth, locks.enabled) if beside else None)
        self._sleep = sleep
        self._helper_args = (model_dir, dtype, max_rows)
        self.no_assist: set[str] = set()  # requests whose helpers failed: they wait for the load
        self.cpu_chunks = 0  # chunks whose LoRA ran on the helpers
        self.device_takeovers = 0  # prefills that began on the helpers and went on on the device
        self.fallbacks = 0  # steps re-run without their CPU chunks
        self.inline_loads = 0  # loads inside a step (load_mode "inline", or an unpaced CPU worker)
        self.inline_wait_s = 0.0  # what those steps waited for them
        self.last_failure = ""
        self.mid_step_takeovers = 0  # of those, prefills the device took over inside a step (between layers)
        self.uncut = 0  # CPU-assisted chunks left whole: their load was expected to land within the step
        self._on_cpu: dict[str, str] = {}  # request -> adapter: prefill run on the helpers, not yet on the device
        self._step_cpu: dict[str, str] = {}  # this step's CPU-assisted chunks: request -> adapter
        self._taken: dict[str, int] = {}  # this step: adapter -> layer from which the device took its rows
        self._waiting: dict[str, str] = {}  # request -> adapter: sitting out for an asynchronous load
        self._inline_step = False  # this step copied an adapter inline (its time is no prefill measurement)
        if self.assist:
            self.lora.landing = self._land
            self.lora.on_host = self._host_changed
            self.lora.share_host()  # from registration on: one shared host copy, mapped by every helper

    def _host_changed(self, name: str, layout: SharedLayout | None) -> None:
        helpers = self.helpers
        if helpers is None:
            return  # announced when they start
        if layout is None:
            helpers.unregister(name)
        else:
            helpers.register(name, layout)

    @property
    def helpers(self) -> CpuLoRAHelpers | None:
        return self.runner.cpu_lora

    def start_helpers(self, *, wait: bool = False) -> None:
        """Spawn the helper processes (usable once they report READY; `wait`: block until then)."""
        if not self.assist or self.loads is None:
            return
        if self.runner.cpu_lora is None:
            model_dir, dtype, max_rows = self._helper_args
            helpers = CpuLoRAHelpers(self.runner.cfg, model_dir, dtype, self.runner.layers, self.processes, max_rows,
                                     cores=self.cores, pace=self.cpu_pace)
            for name, layout in self.lora.layouts.items():
                helpers.register(name, layout)
            self.runner.cpu_lora = helpers
        if wait:
            self.runner.cpu_lora.wait_ready()

    def route(self, out: SchedulerOutput, seq_of: Callable[[str], Sequence]) -> tuple[set[str], str]:
        """Load, flag or hold the step's chunks of cold adapters. Returns the adapters the pool has
        no room for and the error (the engine preempts or fails their requests, as before)."""
        names = {c.adapter for c in out.chunks if c.adapter is not None}
        self._inline_step = False
        self._step_cpu, self._taken = {}, {}
        if not names:
            return set(), ""
        if self.loads is None:  # in-step copy: OnDemand ("inline"), or a CPU worker unpaced
            why = "load_mode inline" if self.load_mode == "inline" else "no link to hide: the load runs in the step"
            for c in out.chunks:
                if c.adapter is not None and c.adapter not in self.lora.resident:
                    self.costs.record(c.seq_id, Choice(INLINE, why, ColdCosts(None, 0.0, None)))
            return self._load_inline(names)
        self.loads.poll()
        now = self.loads._clock()  # noqa: SLF001 - the loader's clock
        waiting = set(self._waiting.values())
        for name, at in self.loads.take_landed_at().items():  # async's wait beyond X, for the inline branch
            if name in waiting and name in self.lora.resident:
                self.costs.observe_async_wait(max(0.0, now - at))
        self._waiting = {s: n for s, n in self._waiting.items() if n not in self.lora.resident}
        for _, kind, nbytes, seconds in self.loads.take_measured():
            self.costs.observe_load(kind, nbytes, seconds)
        self.lora.page_locks.flush()
        cold = names - set(self.lora.resident)
        for c in out.chunks:
            if c.seq_id in self._on_cpu and c.adapter not in cold:
                del self._on_cpu[c.seq_id]
                if seq_of(c.seq_id).num_output_tokens == 0:
                    self.device_takeovers += 1  # mid-prefill: the rest of the prompt on the device
        if not cold:
            return set(), ""
        self.start_helpers()
        ready = self.assist and self.helpers is not None and bool(self.helpers.ready())
        choices = {c.seq_id: self._decide(c, seq_of(c.seq_id), ready, len(out.chunks) - 1)
                   for c in out.chunks if c.adapter in cold}
        inline = {c.adapter for c in out.chunks if choices.get(c.seq_id) == INLINE}
        missing, error = set(), ""
        if inline:
            missing, error = self._load_inline(inline)
            cold -= inline
        for name in sorted(cold):
            try:
                self.loads.start(name, names)
            except MemoryError as exc:
                missing.add(name)
                error = str(exc)
        kept = []
        for c in out.chunks:
            if c.adapter in cold and c.adapter not in missing:
                if choices[c.seq_id] != CPU_ASSIST:
                    self._waiting[c.seq_id] = c.adapter
                    continue  # waits for the load, keeping its KV
                c.lora_on_cpu = True
                if self.cpu_chunk and len(c.token_ids) > self.cpu_chunk:
                    if self._lands_within(c):
                        self.uncut += 1  # the device takes the rest over inside this step
                    else:
                        del c.token_ids[self.cpu_chunk:]  # the rest next step: on the device once the load landed
                        c.sample = False
                self._on_cpu[c.seq_id] = c.adapter
                self._step_cpu[c.seq_id] = c.adapter
                self.cpu_chunks += 1
            kept.append(c)
        out.chunks = kept
        return missing, error

    def _x(self, name: str) -> float:
        """X: seconds until `name` is on the device — the copies ahead of it on the link and its own, at
        the link's measured rate for their host copy kinds (what is left of the one on the link now)."""
        host = self.lora.host.get(name)
        nbytes = host.nbytes if host is not None else 0
        kinds = self.lora.page_locks.kind
        head = self.loads.head_started()
        elapsed = max(0.0, self.loads._clock() - head[1]) if head else 0.0  # noqa: SLF001 - the loader's clock
        queue = [(n, b, kinds(n)) for n, b in self.loads.queue()]
        return self.costs.load_s(name, nbytes, kinds(name), queue, elapsed)

    def _lands_within(self, c: ScheduledChunk) -> bool:
        """The chunk's load is expected to land before the whole chunk would be through its CPU-assisted
        step (measured): the device then takes over inside the step, and cutting it costs a step."""
        whole = self.costs.cpu.predict(len(c.token_ids) * max(self.lora.rank(c.adapter), 1))
        return whole is not None and self._x(c.adapter) < whole

    def _land(self, names: set[str], layer: int) -> set[str]:
        """Between layers of a CPU-assisted step (cpu_lora_batch.py): those of `names` whose load has
        landed, made resident now; their rows take the device path from `layer` on."""
        if self.loads is None or not any(self.loads.landed(n) for n in names):
            return set()
        self.loads.poll()
        done = {n for n in names if n in self.lora.resident}
        for name in done:
            self._taken.setdefault(name, layer)
        for seq_id, name in self._step_cpu.items():
            if name in done and self._on_cpu.pop(seq_id, None) is not None:
                self.device_takeovers += 1
                self.mid_step_takeovers += 1
        return done

    def _decide(self, c: ScheduledChunk, seq: Sequence, ready: bool, others: int) -> str:
        """This chunk's request: CPU assist, async or inline (the fixed modes: assist when it can, else async)."""
        name = c.adapter
        can_assist = (ready and seq.num_output_tokens == 0 and c.seq_id not in self.no_assist
                      and self.helpers.registered(name))
        if self.load_mode != "auto":
            kind = CPU_ASSIST if can_assist else ASYNC
            self.costs.record(c.seq_id, Choice(kind, f"load_mode {self.load_mode}", ColdCosts(None, 0.0, None)))
            return kind
        tokens = max(1, seq.num_prompt_tokens - c.start_pos)
        x = self._x(name)
        rank = self.lora.rank(name)
        costs = ColdCosts(self.costs.cpu_s(tokens, rank, x), x, self.costs.prefill_s(tokens),
                          self.costs.others_s(tokens, rank, x, others))
        choice = choose(costs, ColdSituation(helpers_ready=can_assist, prefilling=seq.num_output_tokens == 0,
                                             load_beside=True, in_flight=self.loads.loading(name), others=others,
                                             async_extra_s=self.costs.async_extra_s(),
                                             since_cpu=self.costs.since_cpu))
        self.costs.record(c.seq_id, choice)
        return choice.kind

    def observe(self, out: SchedulerOutput, started: float, *, synced: bool = True) -> None:
        """After the step ran (since `started`, perf_counter): feed P or T_cpu (cold_costs). A step that
        sampled nothing has not waited for the device: on CUDA it is synced here, only when it had a
        CPU-assisted chunk (a T_cpu measurement; the helpers' waits made it near-synced anyway)."""
        calls, _ = self.helpers.take_calls() if self.helpers is not None else (0, 0.0)
        # T_cpu's x: the step's cold rows x rank (each row goes through every targeted group of every layer;
        # an adapter the device took over mid-step: the share of the layers its rows ran on the helpers)
        stage = self.runner.stage
        work = sum(len(c.token_ids) * max(self.lora.rank(c.adapter), 1)
                   * (self._taken[c.adapter] - stage.start) / max(len(stage), 1) if c.adapter in self._taken
                   else len(c.token_ids) * max(self.lora.rank(c.adapter), 1)
                   for c in out.chunks if c.lora_on_cpu and c.adapter in self.lora.host) if calls else 0
        if not synced:
            if not work:
                return
            if self.runner.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.runner.device)
        self.costs.observe_step(out.num_batched_tokens, time.perf_counter() - started, work, inline=self._inline_step)

    def _load_inline(self, names: set[str]) -> tuple[set[str], str]:
        """Load the step's cold adapters now, the whole batch waiting (paced to `bandwidth`)."""
        cold = [n for n in names if n not in self.lora.resident]
        started = time.perf_counter()
        try:
            self.lora.ensure_resident(names)
        except MemoryError as exc:
            return names - set(self.lora.resident), str(exc)
        if cold:
            moved = sum(self.lora.resident[n][0].nbytes for n in cold)
            if self.runner.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.runner.device)  # the copy is the step's: it waits for it
            self._sleep(max(0.0, started + paced_seconds(moved, self.bandwidth) - time.perf_counter()))
            took = time.perf_counter() - started
            self.inline_loads += len(cold)
            self.inline_wait_s += took
            if self.loads is not None:  # a link that runs beside the steps too: this copy measures it
                self.costs.observe_load(self.lora.page_locks.kind(cold[0]), moved, took)
            self._inline_step = True
        return set(), ""

    def fall_back(self, out: SchedulerOutput, exc: CpuLoRAFailed) -> None:
        """The helpers failed this step: its CPU chunks wait for their loads instead."""
        self.fallbacks += 1
        self.last_failure = str(exc)
        for c in out.chunks:
            if c.lora_on_cpu:
                self.no_assist.add(c.seq_id)
        out.chunks = [c for c in out.chunks if not c.lora_on_cpu]

    def wait_for_load(self, timeout_s: float) -> bool:
        return self.loads.wait(timeout_s) if self.loads is not None else False

    def close(self) -> None:
        if self.loads is not None:
            self.loads.close()
        if self.runner.cpu_lora is not None:
            self.runner.cpu_lora.close()
            self.runner.cpu_lora = None


def _prior_rates(runner: ModelRunner, bandwidth: float | None, page_locked: bool) -> dict[str, float]:
    """The link's rate before any load was timed: the pacing (a CPU worker's stand-in link), or one
    probe copy per host kind on CUDA."""
    if bandwidth is not None:
        return {"pageable": bandwidth}
    if runner.device.type != "cuda":
        return {}
    return probe_link(runner.device, page_locked)
