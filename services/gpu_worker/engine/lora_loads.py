"""Adapter copies to the device that run beside the steps, one link, optionally paced.

`start` reserves the adapter's bytes in the pool on the engine thread (evicting cold adapters
as `ensure_resident` would), then a loader thread copies it — one copy at a time, as over one
PCIe link — and `poll`, called by the engine at each step (a chunk boundary), makes the landed
ones resident. On CUDA the copy is the real host-to-device copy, on the loader's own stream. On a CPU worker it is a
memory copy that takes microseconds, so `bandwidth` (the worker's `lora_load_bandwidth`)
stretches each copy to nbytes / bandwidth: a PCIe-like cold start, for tests and demos. It is
a simulation of the link, not a measurement of one; unset, nothing is paced.

Every copy is timed (`take_measured`: name, link kind, bytes, seconds — the kind from `kind_of`,
"pageable" or "page-locked", lora_page_lock.py), and `queue` / `head_started` tell how much is on
the link ahead of a new load: what the cold-start rule's X is made of (cold_costs.py).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .lora import LoRAAdapter, LoRAManager


def paced_seconds(nbytes: int, bandwidth: float | None) -> float:
    """How long a paced copy of `nbytes` takes at `bandwidth` bytes/s (0 when unpaced)."""
    if bandwidth is None:
        return 0.0
    if bandwidth <= 0:
        raise ValueError(f"lora_load_bandwidth must be > 0 bytes/s, got {bandwidth}")
    return nbytes / bandwidth


def pacing_wait(started: float, now: float, nbytes: int, bandwidth: float | None) -> float:
    """Seconds still to wait, at `now`, for a copy started at `started` to have taken its paced time."""
    return max(0.0, started + paced_seconds(nbytes, bandwidth) - now)


class AdapterLoads:
    def __init__(self, lora: LoRAManager, bandwidth: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        paced_seconds(1, bandwidth)  # refuse a bad bandwidth now
        self.lora = lora
        self.bandwidth = bandwidth
        self._clock, self._sleep = clock, sleep
        self._inflight: dict[str, tuple[LoRAAdapter, Any]] = {}  # name -> (host copy, pool charge)
        self._landed: dict[str, LoRAAdapter | BaseException] = {}
        self._lock = threading.Lock()
        self._work: queue.Queue[tuple[str, LoRAAdapter] | None] = queue.Queue()
        self._arrived = threading.Event()
        self._thread: threading.Thread | None = None
        self._copy_stream: Any = None  # CUDA: the loader's own stream (made on first use)
        self.loads = 0  # copies completed (for stats and tests)
        self.kind_of: Callable[[str], str] = lambda _name: "pageable"
        self._measured: list[tuple[str, str, int, float]] = []  # (name, kind, bytes, seconds) of landed copies
        self._head: tuple[str, float] | None = None  # the copy on the link now and when it started
        self._landed_at: dict[str, float] = {}  # clock time each copy landed (landing to use: async's wait)

    def queue(self) -> list[tuple[str, int]]:
        """(name, bytes) of the copies not landed yet, in link order (the first may be on the link)."""
        with self._lock:
            landed = set(self._landed)
        return [(n, src.nbytes) for n, (src, _) in self._inflight.items() if n not in landed]

    def head_started(self) -> tuple[str, float] | None:
        """(name, clock time) of the copy on the link now, if any."""
        return self._head

    def take_landed_at(self) -> dict[str, float]:
        """name -> clock time its copy landed, for the copies landed since the last call."""
        with self._lock:
            out, self._landed_at = self._landed_at, {}
        return out

    def take_measured(self) -> list[tuple[str, str, int, float]]:
        with self._lock:
            out, self._measured = self._measured, []
        return out

    def loading(self, name: str) -> bool:
        return name in self._inflight

    def start(self, name: str, keep: list[str] | set[str] = ()) -> None:  # type: ignore[assignment]
        """Begin loading `name` (engine thread). MemoryError if the pool has no room for it."""
        if name in self._inflight or name in self.lora.resident:
            return
        source, charge = self.lora.reserve(name, keep)
        self._inflight[name] = (source, charge)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lora-loader", daemon=True)
            self._thread.start()
        self._work.put((name, source))

    def landed(self, name: str) -> bool:
        """The copy of `name` is done, not yet made resident (the next `poll` will)."""
        with self._lock:
            return name in self._landed

    def poll(self) -> list[str]:
        """Landed copies become resident (engine thread); returns their names."""
        with self._lock:
            landed, self._landed = self._landed, {}
        done = []
        for name, moved in landed.items():
            source, charge = self._inflight.pop(name)
            if isinstance(moved, BaseException):
                self.lora.pool.release(charge)  # the next step that needs it starts over
                continue
            if moved_on_cuda(moved):
                _used_on_current_stream(moved)
            if self.lora.admit(name, source, moved, charge):
                done.append(name)
        return done

    def wait(self, timeout_s: float) -> bool:
        """Block until some copy lands (or `timeout_s`); True if one did."""
        hit = self._arrived.wait(timeout_s)
        self._arrived.clear()
        return hit

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(5)
            self._thread = None

    def _to_cuda(self, adapter: LoRAAdapter, device: Any) -> LoRAAdapter:
        """The host-to-device copy on the loader's own stream, waited for on that stream alone: the
        engine's kernels on the compute stream run on meanwhile (a sync of the device or of the
        default stream would stall them)."""
        import torch

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._copy_stream):
            moved = adapter.to(device, non_blocking=True)  # a DMA from a page-locked host copy
        self._copy_stream.synchronize()
        return moved

    def _run(self) -> None:
        device = self.lora.device
        while (item := self._work.get()) is not None:
            name, source = item
            started = self._clock()
            self._head = (name, started)
            kind = self.kind_of(name)
            try:
                if device.type == "cuda":
                    moved = self._to_cuda(source, device)
                else:
                    moved = source.to(device) if device.type != "cpu" else _copied(source)
                self._sleep(pacing_wait(started, self._clock(), source.nbytes, self.bandwidth))
                result: LoRAAdapter | BaseException = moved
            except Exception as exc:  # noqa: BLE001 - reported through poll (the load is retried)
                result = exc
            landed = self._clock()
            took = landed - started
            with self._lock:
                self._landed[name] = result
                self._landed_at[name] = landed
                self.loads += 1
                if not isinstance(result, BaseException):
                    self._measured.append((name, kind, source.nbytes, took))
            self._head = None
            self._arrived.set()


def _copied(adapter: LoRAAdapter) -> LoRAAdapter:
    """A CPU "device copy": a real memory copy, so the resident weights are not the host's."""
    return LoRAAdapter(adapter.name, adapter.rank, {k: (a.clone(), b.clone()) for k, (a, b) in adapter.weights.items()})


def moved_on_cuda(adapter: LoRAAdapter) -> bool:
    return any(a.is_cuda for a, _ in adapter.weights.values())


def _used_on_current_stream(adapter: LoRAAdapter) -> None:
    """Allocated on the copy stream, used on the engine's: tell the caching allocator, so the
    memory is not handed to the copy stream again while a compute kernel may still read it."""
    import torch

    stream = torch.cuda.current_stream()
    for a, b in adapter.weights.values():
        a.record_stream(stream)
        b.record_stream(stream)


PROBE_BYTES = 16 << 20  # one probe copy per host kind: long enough to be the link, not the launch


def probe_link(device: Any, page_locked: bool, nbytes: int = PROBE_BYTES) -> dict[str, float]:
    """CUDA: the host-to-device rate of a pageable copy and, when host copies are page-locked, of a
    pinned one (bytes/s, the best of three each): the cold-start rule's X before any load was timed."""
    import torch

    src = {"pageable": torch.empty(nbytes, dtype=torch.uint8)}
    if page_locked:
        src["page-locked"] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for kind, host in src.items():
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        rates[kind] = nbytes / best
    return rates
