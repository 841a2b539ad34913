"""Requests whose adapter is not on the device (CaraServe §4): load it, and meanwhile prefill on CPU.

Each step (`route`, before the runner): landed loads become resident — this is the chunk
boundary where the device path takes over. For every chunk whose adapter is still cold the
adapter's load is started (paced, `lora_loads`), then:

* a prefill chunk (the request has produced no token yet) goes to the CPU helpers
  (`lora_on_cpu`) when assist is on and a helper is ready: the prefill starts at once;
* any other chunk — decoding, assist off, no helper, or a request whose helper failed — sits
  the step out, keeping its KV, until the load lands (OnDemand).

When the helpers fail during a step (`fall_back`), the CPU chunks are removed, their requests
wait for the load from then on (never a token from half-computed deltas), and the step runs
again without them: every KV write is at the same positions, so re-running is exact.

Loads run beside the steps only where there is something to hide: on CUDA, or when the worker
paces its loads (`lora_load_bandwidth`). A CPU worker without pacing loads in the step, as
before (a memory copy), and starts no helpers.
"""
from __future__ import annotations

from collections.abc import Callable

from .batch import SchedulerOutput
from .cpu_lora_helpers import CpuLoRAFailed, CpuLoRAHelpers
from .lora_loads import AdapterLoads
from .model_runner import ModelRunner
from .sequence import Sequence


class ColdStart:
    def __init__(self, runner: ModelRunner, *, assist: bool, processes: int, bandwidth: float | None,
                 model_dir: str, dtype: str | None, max_rows: int) -> None:
        self.runner = runner
        self.lora = runner.lora
        self.assist = assist and processes > 0
        self.processes = processes
        self.loads = AdapterLoads(self.lora, bandwidth) if bandwidth is not None or runner.device.type == "cuda" else None
        self._helper_args = (model_dir, dtype, max_rows)
        self.no_assist: set[str] = set()  # requests whose helpers failed: they wait for the load
        self.cpu_chunks = 0  # chunks whose LoRA ran on the helpers
        self.fallbacks = 0  # steps re-run without their CPU chunks
        self.last_failure = ""

    @property
    def helpers(self) -> CpuLoRAHelpers | None:
        return self.runner.cpu_lora

    def start_helpers(self, *, wait: bool = False) -> None:
        """Spawn the helper processes (usable once they report READY; `wait`: block until then)."""
        if not self.assist or self.loads is None:
            return
        if self.runner.cpu_lora is None:
            model_dir, dtype, max_rows = self._helper_args
            self.runner.cpu_lora = CpuLoRAHelpers(self.runner.cfg, model_dir, dtype, self.runner.layers,
                                                  self.processes, max_rows)
        if wait:
            self.runner.cpu_lora.wait_ready()

    def route(self, out: SchedulerOutput, seq_of: Callable[[str], Sequence]) -> tuple[set[str], str]:
        """Load, flag or hold the step's chunks of cold adapters. Returns the adapters the pool has
        no room for and the error (the engine preempts or fails their requests, as before)."""
        names = {c.adapter for c in out.chunks if c.adapter is not None}
        if not names:
            return set(), ""
        if self.loads is None:  # in-step copy (a CPU worker, unpaced)
            try:
                self.lora.ensure_resident(names)
                return set(), ""
            except MemoryError as exc:
                return names - set(self.lora.resident), str(exc)
        self.loads.poll()
        cold = names - set(self.lora.resident)
        if not cold:
            return set(), ""
        missing, error = set(), ""
        for name in sorted(cold):
            try:
                self.loads.start(name, names)
            except MemoryError as exc:
                missing.add(name)
                error = str(exc)
        self.start_helpers()
        ready = self.assist and self.helpers is not None and bool(self.helpers.ready())
        kept = []
        for c in out.chunks:
            if c.adapter in cold and c.adapter not in missing:
                seq = seq_of(c.seq_id)
                if not (ready and seq.num_output_tokens == 0 and c.seq_id not in self.no_assist
                        and c.adapter in self.lora.paths):
                    continue  # waits for the load, keeping its KV
                c.lora_on_cpu = True
                self.cpu_chunks += 1
            kept.append(c)
        out.chunks = kept
        return missing, error

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
