"""The cluster of `tidal bench lora`: one local cluster, one CPU gpu_worker per mode.

Every mode has its own worker and its own base-model name (the same checkpoint), so a request
reaches the mode its model names, and all modes stay up for the whole run: the bench interleaves
them round by round instead of running one cluster per mode after another (less drift between
modes on a shared machine). Each round registers fresh adapter names (the same files), so an
adapter is cold on its first request of the round in every mode but cached.

Workers differ only in adapter management; all run the same LoRA kernel (`[policies] lora_kernel`):
* cached: every adapter of every round resident at start (the oracle);
* ondemand: loaded when a request needs it (paced), the request waits; room to keep what it loaded;
* slora: the same on-demand load into a unified pool (KV and adapters) sized tight, so LRU evicts
  adapters to make room — S-LoRA's unified paging; a reused adapter may be cold again;
* cpu_assist: as ondemand, and the prefill of a cold adapter runs on CPU LoRA helpers meanwhile.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from loadgen.runner.bench_cluster import BenchCluster, launch, terminate

MODES = ("cached", "ondemand", "slora", "cpu_assist")
SERVICES = ("registry", "dispatcher", "gateway")

HEAD = """
[cluster]
data_dir = "{data}"

[gateway]
port = {port}

[dispatcher]
queue_bound = 4096

[planner]
enabled = false

[policies]
lora_kernel = "{kernel}"
cpu_lora_assist = true

[observability]
log_level = "warning"
"""

WORKER = """
[[models]]
name = "{model}"
path = "{path}"
max_context = 1024

[[workers]]
id = "{worker}"
device = "cpu"
memory = {memory}
models = ["{model}"]
adapters = {resident}
cpu_lora_processes = {processes}
lora_load_bandwidth = {bandwidth}
stream_interval = "0s"
"""


def model_name(mode: str) -> str:
    return "base-" + mode.replace("_", "-")


def adapter_name(mode: str, rnd: int, slot: int) -> str:
    """cached keeps one name per slot (all resident); the others get fresh names every round."""
    tag = mode.replace("_", "-")
    return f"{tag}-{slot:03d}" if mode == "cached" else f"{tag}-r{rnd}-{slot:03d}"


def warm_adapter(mode: str) -> str:
    return mode.replace("_", "-") + "-warmup"


def config_text(*, data: Path, port: int, model: Path, adapters: list[tuple[int, Path]], rounds: int,
                modes: list[str], kernel: str, bandwidth: float, processes: int, memory: dict[str, int],
                warmups: list[tuple[int, Path]]) -> str:
    """`adapters`: (rank, dir) per slot; `warmups`: (rank, dir) of each warm-up adapter (`warm_adapter`-j);
    `memory`: pool bytes per mode."""
    parts = [HEAD.format(data=data, port=port, kernel=kernel)]
    for mode in modes:
        names = sorted({adapter_name(mode, r, s) for r in range(rounds) for s in range(len(adapters))})
        parts.append(WORKER.format(
            model=model_name(mode), path=model, worker=f"lora-{mode.replace('_', '-')}", memory=memory[mode],
            resident="[" + ", ".join(f'"{n}"' for n in names) + "]" if mode == "cached" else "[]",
            processes=processes if mode == "cpu_assist" else 0, bandwidth=bandwidth))
        spec = [(f"{warm_adapter(mode)}-{j}", rank, path) for j, (rank, path) in enumerate(warmups)]
        for name in names:
            rank, path = adapters[int(name[-3:])]
            spec.append((name, rank, path))
        parts += [f'\n[[adapters]]\nname = "{n}"\nbase = "{model_name(mode)}"\npath = "{p}"\nrank = {r}\n'
                  f'targets = ["q_proj", "k_proj", "v_proj"]\n' for n, r, p in spec]
    return "".join(parts)


class LoRACluster(BenchCluster):
    """nats-server, registry, dispatcher, gateway and one gpu_worker per mode; real processes."""

    def __init__(self, root: Path, config: Path, modes: list[str], threads: int) -> None:
        super().__init__(root, config)
        self.modes, self.threads = modes, threads

    def start(self, gateway_url: str, timeout_s: float = 300.0) -> None:
        logs = self.start_nats()
        units = [(s, f"services.{s}", []) for s in SERVICES]
        units += [(f"worker-{m}", "services.gpu_worker",
                   ["--worker-id", f"lora-{m.replace('_', '-')}", "--threads", str(self.threads)]) for m in self.modes]
        for name, module, extra in units:
            self.procs[name] = launch(module, self.nats_url, self.config, f"bench-{name}", logs / f"{name}.log", *extra)
        self.wait_serving(gateway_url, time.monotonic() + timeout_s)

    def stop(self) -> None:
        """Workers first (they deregister from a live registry and close their CPU helpers), then the rest."""
        procs = list(self.procs.values())[::-1]
        for batch in (procs[:len(self.modes)], procs[len(self.modes):]):
            terminate(batch)
        if self.nats is not None:
            self.nats.stop()
