"""The engines of `tidal bench lora`, one per mode in this process, and the open-loop driver of a round.

Modes (CaraServe §7.1's baselines, and ours), each on its own kernel, each measured against a
Cached on the same kernel:
* cached: every adapter of the round resident before it starts (the oracle), on the bench's kernel
  (`--kernel`, default segmented);
* cached_bgmv / cached_mbgmv: the same on BGMV (`padded`, Punica's, what the paper's OnDemand runs)
  / on MBGMV (`segmented`, S-LoRA's) — needed where `--kernel` is the other one;
* ondemand: the step that needs a cold adapter loads it first, the whole batch waits (LightLLM's
  on-demand loading, the paper's OnDemand: Fig. 11's long prefill iterations), on BGMV;
* slora: the same loading with S-LoRA's own kernel (MBGMV); its unified pool of KV and adapters is
  what every mode's pool is here (one pool per device, LRU over adapters);
* async: our asynchronous load beside the steps without CPU assist: only the cold request waits;
* cpu_assist: the asynchronous load, and meanwhile the prefill runs with its LoRA part on the CPU
  helpers, in chunks, the device taking over at the first chunk after the load lands;
* auto: the engine's decision rule per cold request (CPU assist, async or inline by T_cpu < X + P,
  shared/policy/lora_cold_choice.py), what a worker runs.
`cpu_assist@R` / `auto@R`: the helpers paced so a typical prompt's CPU LoRA part is R x its
prefill here (`cpu_lora_pace`, lora.py derives it); a mode without `@`: the helpers unpaced.

Loads: on CUDA the real host-to-device copy (no pacing unless asked); on a CPU engine a memory copy
paced to `bandwidth`. Cores: `split_cores` gives the helpers cores of their own where the machine
has them; this process (every mode's engine, one at a time) is pinned to the rest.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("cached", "cached_bgmv", "cached_mbgmv", "ondemand", "slora", "async", "cpu_assist", "auto")
CACHED = ("cached", "cached_bgmv", "cached_mbgmv")
OWN_KERNEL = {"cached_bgmv": "padded", "ondemand": "padded", "cached_mbgmv": "segmented", "slora": "segmented"}
ASSISTED = ("cpu_assist", "auto")  # modes with CPU LoRA helpers (may carry @R)


def base_mode(mode: str) -> str:
    """`cpu_assist@1.77` -> `cpu_assist`; refuses an unknown mode or a ratio on a mode without helpers."""
    name, _, ratio = mode.partition("@")
    if name not in MODES or (ratio and name not in ASSISTED):
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)} ({'/'.join(ASSISTED)} may take @R)")
    if ratio:
        try:
            if float(ratio) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"mode {mode!r}: the CPU-LoRA-to-prefill ratio must be a number > 0") from None
    return name


def kernel_of(mode: str, kernel: str) -> str:
    """The mode's LoRA kernel: OnDemand's BGMV, S-LoRA's MBGMV, the bench's `kernel` for the others."""
    return OWN_KERNEL.get(base_mode(mode), kernel)


def baseline_of(mode: str, modes: list[str], kernel: str) -> str | None:
    """The Cached arm on the mode's kernel among `modes` (None: none ran)."""
    want = kernel_of(mode, kernel)
    return next((c for c in CACHED if c in modes and kernel_of(c, kernel) == want), None)


@dataclass(frozen=True, slots=True)
class CoreSplit:
    machine: tuple[int, ...]  # the CPUs this process may use
    engine: tuple[int, ...]
    helpers: tuple[int, ...]  # empty: not pinned (too few cores), helpers share the engine's

    def describe(self) -> str:
        if not self.helpers:
            return (f"cores: {len(self.machine)} usable, too few to split: engine and CPU LoRA helpers share them "
                    f"(not pinned)")
        return (f"cores: {len(self.machine)} usable; engine pinned to {len(self.engine)} ({_cpus(self.engine)}), "
                f"CPU LoRA helpers to {len(self.helpers)} of their own ({_cpus(self.helpers)})")


def _cpus(cores: tuple[int, ...]) -> str:
    return "cpu " + ",".join(map(str, cores))


def usable_cores() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cores(cores: tuple[int, ...], helpers: int | None = None) -> CoreSplit:
    """Half the cores (at least one, at most `helpers` when given) to the helpers, the rest to the engine;
    one core: nothing pinned."""
    if len(cores) < 2:
        return CoreSplit(cores, cores, ())
    n = max(1, len(cores) // 2) if helpers is None else max(1, min(helpers, len(cores) - 1))
    return CoreSplit(cores, cores[:len(cores) - n], cores[len(cores) - n:])


def pin_engine(split: CoreSplit) -> None:
    """This thread (the engines' steps run on it; later threads inherit) to the engine's cores."""
    if split.helpers and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(split.engine))


@dataclass
class ModeEngine:
    mode: str
    engine: object  # LLMEngine
    names: list[str] = field(default_factory=list)  # adapters registered for the current round


def make_engine(mode: str, model: Path, *, device: str, kernel: str, bandwidth: float | None, processes: int,
                cores: tuple[int, ...], chunk: int, pool_bytes: int, max_model_len: int, budget: int,
                max_seqs: int, cpu_pace: float = 0.0, page_lock: bool = True):  # type: ignore[no-untyped-def]
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    name = base_mode(mode)
    helped = name in ASSISTED
    load = "inline" if name in ("ondemand", "slora") else "auto" if name == "auto" else "async"
    cfg = EngineConfig(
        str(model), device=device, pool_bytes=pool_bytes, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, lora_mode=kernel_of(mode, kernel),
        lora_load_bandwidth=bandwidth, lora_load_mode=load,
        cpu_lora_assist=helped, cpu_lora_processes=processes if helped else 0,
        cpu_lora_chunk=chunk, cpu_lora_cores=cores if helped else (), cpu_lora_pace=cpu_pace if helped else 0.0,
        lora_page_lock=page_lock,  # CUDA only: page-locked host copies of adapters
        prefix_caching=False)  # prefill cost is what is measured (the calibration repeats one prompt)
    return LLMEngine(cfg)


def register_round(me: ModeEngine, names: list[tuple[str, Path]]) -> None:
    """Drop the last round's adapters, register this round's (not on the request path: CaraServe's
    adapters are in host memory before their requests come); cached: all on the device now."""
    eng = me.engine
    for name in me.names:
        eng.remove_lora(name)
    me.names = [n for n, _ in names]
    for name, path in names:
        eng.add_lora(name, path)
    if me.mode in CACHED:
        eng.runner.lora.ensure_resident(me.names)


@dataclass
class RoundResult:
    requests: list[dict]
    prefill_steps_s: list[float]  # steps that ran a prefill chunk (Fig. 11)
    decode_steps_s: list[float]  # steps of decoding only


_DRIVES = itertools.count()


def drive(eng, trace: list, names: list[str], output_len: int, *, sync=None) -> RoundResult:  # type: ignore[no-untyped-def]
    """Open loop: each request is added at its arrival time (wall clock), the engine steps whenever it
    has work; TTFT = first token - arrival."""
    from services.gpu_worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    tag = f"d{next(_DRIVES)}-"  # request ids unique across rounds: the engine counts a request's cold choice once
    schedule = eng.scheduler.schedule
    last: list = [None]

    def spy():  # type: ignore[no-untyped-def]
        out = schedule()
        last[0] = out
        return out

    eng.scheduler.schedule = spy
    start = time.perf_counter()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, int] = {}
    prefill_steps, decode_steps = [], []
    pending = list(enumerate(trace))
    try:
        while pending or eng.has_unfinished:
            now = time.perf_counter()
            while pending and start + pending[0][1].at_s <= now:
                i, req = pending.pop(0)
                rid = f"{tag}r{i}"
                arrival[rid] = start + req.at_s
                eng.add_request(rid, req.prompt, params, adapter=names[i])
            if not eng.has_unfinished:
                time.sleep(max(0.0, start + pending[0][1].at_s - time.perf_counter()))
                continue
            t0 = time.perf_counter()
            outs = eng.step()
            if sync is not None:
                sync()
            t1 = time.perf_counter()
            out = last[0]
            if out is not None and out.chunks:
                (prefill_steps if any(len(c.token_ids) > 1 or c.start_pos == 0 for c in out.chunks)
                 else decode_steps).append(t1 - t0)
            for d in outs:
                if d.new_token_ids:
                    first.setdefault(d.request_id, t1)
                    tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.new_token_ids)
                if d.finished:
                    done[d.request_id] = t1
    finally:
        eng.scheduler.schedule = schedule
    rows = []
    for i, req in enumerate(trace):
        rid = f"{tag}r{i}"
        if rid not in first or rid not in done:
            raise RuntimeError(f"request {rid} ({names[i]}) did not finish")
        n = max(tokens.get(rid, 1), 1)
        rows.append({"request": i, "slot": req.slot, "rank": req.rank, "cold": req.cold, "prompt": len(req.prompt),
                     "ttft_s": first[rid] - arrival[rid], "tpot_s": (done[rid] - first[rid]) / max(n - 1, 1),
                     "e2e_s": done[rid] - arrival[rid]})
    return RoundResult(rows, prefill_steps, decode_steps)


__all__ = ["ASSISTED", "CACHED", "MODES", "base_mode", "baseline_of", "kernel_of", "CoreSplit", "ModeEngine", "RoundResult", "drive", "make_engine", "pin_engine",
           "register_round", "split_cores", "usable_cores"]
