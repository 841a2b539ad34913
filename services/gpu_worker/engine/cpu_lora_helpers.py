"""The engine's side of its CPU LoRA helper processes: shared regions, the plan, restarts.

One input and one output region in shared memory, sized for a step's token budget at the
widest group; per layer and projection group the engine writes the cold rows' input once
(`submit`: one-to-N), each helper computes its planned share and writes its rows of the
output, and `wait` collects the DONE records (fixed-size headers over a pipe; no pickling).

Sync-free invocation (§4.2, Fig. 8): on CUDA the input rows go to the shared input region by
an asynchronous device-to-host copy (the region is page-locked with cudaHostRegister) and the
signal is a second asynchronous copy, queued right behind it on the same stream, that writes
the call's gate number into a shared doorbell. The COMPUTE records go out at once and each
helper waits for the doorbell to reach its gate: stream order guarantees the rows landed
first, and the engine thread never waits for the GPU, so the base projection's kernels are
launched behind the copy without a stall. `sync_free=False` is PyTorch's native way (a
blocking copy, then the signal), kept for the comparison. On a CPU engine the copy is a
memory copy and the doorbell a plain store.

Adapters: every adapter the worker registers is announced to every helper at once (REGISTER with
its `SharedLayout`: the worker's one host copy in a shared file, `lora_shared`), and again to a
helper that restarts; helpers map it and never read an adapter directory, so nothing on the
request path touches a file. A dropped adapter is UNREGISTERed.

Cores: `cores` (the CPUs the helpers may use) pins helper i to cores[i % len(cores)].

Faults: a helper that dies (EOF or a broken pipe), hangs past `hang_s`, or answers an error
makes the call raise `CpuLoRAFailed`; it is killed and restarted at once (usable again once it
reports READY) and the engine lets those requests wait for their adapter's load instead.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import torch

from .cpu_lora_helper import helper_main
from .cpu_lora_plan import split_rows, updated_throughput
from .cpu_lora_wire import Kind, Record, Status, decode, group_layout, region_widths
from .lora_shared import SharedLayout
from .model_config import ModelConfig

MIN_ROWS_PER_HELPER = 16
HANG_S = 30.0


class CpuLoRAFailed(RuntimeError):
    """A helper could not deliver this call's deltas; the caller must not use them."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [row, row + count) of the packed cold input belong to `adapter` (registered with the helpers)."""

    adapter: str
    rank: int
    row: int
    count: int


@dataclass(slots=True)
class _Helper:
    index: int
    proc: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    throughput: float = 0.0


@dataclass(slots=True)
class Ticket:
    rows: int
    out_cols: int
    pending: dict[int, tuple[_Helper, int, int]]  # seq -> (helper, rows, rank)
    work: int = 0  # cold row x rank products of the call
    t0: float = 0.0  # when it was submitted (perf_counter)


class CpuLoRAHelpers:
    def __init__(self, cfg: ModelConfig, model_dir: str, dtype: str | None, layers: range, processes: int,
                 max_rows: int, *, hang_s: float = HANG_S, sync_free: bool = True,
                 cores: Sequence[int] = (), pace: float = 0.0) -> None:
        if processes < 1:
            raise ValueError(f"cpu_lora_processes must be >= 1, got {processes}")
        if not pace >= 0:
            raise ValueError(f"cpu_lora_pace must be >= 0 s per row x rank, got {pace}")
        self.pace = pace
        self.cfg, self.max_rows, self.hang_s = cfg, max_rows, hang_s
        self._args = (model_dir, dtype, layers.start, layers.stop)
        in_w, out_w = region_widths(cfg)
        size = cfg.dtype.itemsize
        self._shm_in = SharedMemory(create=True, size=max(1, max_rows * in_w * size))
        self._shm_out = SharedMemory(create=True, size=max(1, max_rows * out_w * size))
        self._shm_bell = SharedMemory(create=True, size=8)
        self._x = torch.frombuffer(self._shm_in.buf, dtype=cfg.dtype)
        self._y = torch.frombuffer(self._shm_out.buf, dtype=cfg.dtype)
        self._bell = torch.frombuffer(self._shm_bell.buf, dtype=torch.int64)
        self._bell.zero_()
        self._gates = itertools.count(1)
        self.sync_free = sync_free
        self._registered: list[torch.Tensor] = []  # host regions page-locked for async copies (CUDA)
        self._bell_dev: dict[torch.device, torch.Tensor] = {}
        self._ctx = mp.get_context("spawn")  # never fork the worker's threads
        self.cores = tuple(cores)
        self._adapters: dict[str, tuple[int, SharedLayout]] = {}  # name -> (id, its shared host copy)
        self._next_id = itertools.count(1)
        self._seq = itertools.count(1)
        self.tap: Callable[[str, int, bytes], None] | None = None  # tests: (way, helper, record) of every record
        self.restarts = 0
        self._work, self._call_s = 0, 0.0  # since `take_calls`: row x rank products, seconds submit -> deltas
        self._helpers = [self._spawn(i) for i in range(processes)]

    # --- processes ------------------------------------------------------------------------
    def _spawn(self, index: int) -> _Helper:
        ours, theirs = self._ctx.Pipe(duplex=True)
        core = self.cores[index % len(self.cores)] if self.cores else -1
        proc = self._ctx.Process(target=helper_main, name=f"cpu-lora-{index}", daemon=True,
                                 args=(theirs, self._shm_in.name, self._shm_out.name, self._shm_bell.name, *self._args,
                                       core, self.pace))
        proc.start()
        theirs.close()
        helper = _Helper(index, proc, ours)
        for aid, layout in self._adapters.values():  # every registered adapter, before any COMPUTE
            try:
                self._send(helper, Record(Kind.REGISTER, adapter=aid, path=layout.encode()))
            except OSError:
                break  # died at once: `ready` restarts it
        return helper

    def _restart(self, helper: _Helper) -> None:
        if helper.proc.is_alive():
            helper.proc.kill()
        helper.proc.join(5)
        helper.conn.close()
        self._helpers[helper.index] = self._spawn(helper.index)
        self.restarts += 1

    def pids(self) -> list[int | None]:
        return [h.proc.pid for h in self._helpers]

    def ready(self) -> list[_Helper]:
        """Helpers able to take work now (READY seen); dead ones are restarted (ready later)."""
        for h in list(self._helpers):
            if not h.ready:
                try:
                    while h.conn.poll(0):
                        rec = self._recv(h)
                        if rec.kind is Kind.READY:
                            h.ready, h.throughput = True, max(rec.value, 1.0)
                except (EOFError, OSError, ValueError):
                    self._restart(h)
                    continue
            if not h.proc.is_alive():
                self._restart(h)
        return [h for h in self._helpers if h.ready]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ready()) < len(self._helpers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CPU LoRA helpers not ready after {timeout_s}s")
            time.sleep(0.01)

    def take_calls(self) -> tuple[int, float]:
        """(row x rank products, seconds from each submit to its deltas) of the calls since the last
        take: a step's T_cpu measurement (the base projection runs inside those seconds)."""
        out, (self._work, self._call_s) = (self._work, self._call_s), (0, 0.0)
        return out

    # --- the channel ----------------------------------------------------------------------
    def _send(self, h: _Helper, rec: Record) -> None:
        data = rec.encode()
        if self.tap is not None:
            self.tap("sent", h.index, data)
        h.conn.send_bytes(data)

    def _recv(self, h: _Helper) -> Record:
        data = h.conn.recv_bytes()
        if self.tap is not None:
            self.tap("received", h.index, data)
        return decode(data)

    # --- adapters ------------------------------------------------------------------------
    def register(self, name: str, layout: SharedLayout) -> None:
        """Announce `name`'s shared host copy to every helper (replacing an earlier one of that name)."""
        self.unregister(name)
        aid = next(self._next_id)
        self._adapters[name] = (aid, layout)
        self._broadcast(Record(Kind.REGISTER, adapter=aid, path=layout.encode()))

    def unregister(self, name: str) -> None:
        entry = self._adapters.pop(name, None)
        if entry is not None:
            self._broadcast(Record(Kind.UNREGISTER, adapter=entry[0]))

    def registered(self, name: str) -> bool:
        return name in self._adapters

    def _broadcast(self, rec: Record) -> None:
        for h in self._helpers:
            try:
                self._send(h, rec)
            except OSError:  # it died: the restart replays every registration
                pass

    # --- one layer's group ----------------------------------------------------------------
    def submit(self, layer: int, group: int, x: torch.Tensor, segments: list[Segment]) -> Ticket:
        """Start the deltas of `group` at `layer` for the packed cold rows `x` [n, in_dim]."""
        n = x.shape[0]
        in_dim, cols = group_layout(self.cfg, group)
        out_cols = sum(w for _, _, w in cols)
        if n > self.max_rows:
            raise CpuLoRAFailed(f"{n} cold rows exceed the shared region's {self.max_rows}")
        helpers = self.ready()
        if not helpers:
            raise CpuLoRAFailed("no CPU LoRA helper is ready")
        missing = [seg.adapter for seg in segments if seg.adapter not in self._adapters]
        if missing:
            raise CpuLoRAFailed(f"adapters {missing} are not registered with the CPU LoRA helpers")
        t0 = time.perf_counter()
        gate = self._publish(x, n * in_dim)
        ticket = Ticket(n, out_cols, {}, sum(seg.count * max(seg.rank, 1) for seg in segments), t0)
        plan = split_rows(n, [h.throughput for h in helpers], MIN_ROWS_PER_HELPER)
        for hi, start, count in plan:
            h = helpers[hi]
            for seg in segments:
                lo, hi_row = max(start, seg.row), min(start + count, seg.row + seg.count)
                if lo >= hi_row:
                    continue
                seq = next(self._seq)
                try:
                    aid = self._adapters[seg.adapter][0]
                    self._send(h, Record(Kind.COMPUTE, seq=seq, adapter=aid, layer=layer, group=group, row=lo,
                                         count=hi_row - lo, in_dim=in_dim, out_cols=out_cols, gate=gate))
                except OSError as exc:  # BrokenPipeError: it died
                    self._fail(ticket, h, f"helper {h.index} is gone ({exc!r})")
                ticket.pending[seq] = (h, hi_row - lo, seg.rank)
        return ticket

    def _publish(self, x: torch.Tensor, numel: int) -> int:
        """The rows into the input region, then the doorbell; returns the gate helpers wait for."""
        gate = next(self._gates)
        rows = self._x[:numel].view(x.shape)
        if x.is_cuda and self.sync_free:
            self._pin()
            rows.copy_(x, non_blocking=True)  # queued on the stream, behind the kernels that made x
            bell = self._bell_dev.get(x.device)
            if bell is None:
                bell = self._bell_dev[x.device] = torch.zeros(1, dtype=torch.int64, device=x.device)
            bell.fill_(gate)
            self._bell.copy_(bell, non_blocking=True)  # the signal: lands after the rows, in stream order
        else:
            rows.copy_(x)  # blocking on CUDA: the native invocation
            self._bell[0] = gate
        return gate

    def _pin(self) -> None:
        """Page-lock the input region and the doorbell once, so device-to-host copies are async."""
        if self._registered:
            return
        cudart = torch.cuda.cudart()
        for t in (self._x, self._bell):
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a CPU LoRA region failed: {err}")
            self._registered.append(t)

    def wait(self, ticket: Ticket) -> torch.Tensor:
        """The deltas [n, out_cols] (a view of the output region, valid until the next submit)."""
        while ticket.pending:
            h = next(iter(ticket.pending.values()))[0]
            deadline = time.monotonic() + self.hang_s
            try:
                while not h.conn.poll(0.05):
                    if not h.proc.is_alive() or time.monotonic() > deadline:
                        raise EOFError("dead or hung")
                rec = self._recv(h)
            except (EOFError, OSError, ValueError) as exc:
                self._fail(ticket, h, f"helper {h.index} failed mid-call ({exc!r})")
            if rec.kind is not Kind.DONE or rec.seq not in ticket.pending:
                continue  # a late answer to a call that already failed
            _, rows, rank = ticket.pending.pop(rec.seq)
            if rec.status != Status.OK:
                self._fail(ticket, None, f"helper {h.index}: {Status(rec.status).name} for call {rec.seq}")
            h.throughput = updated_throughput(h.throughput, rows, rank, rec.value)
        self._work += ticket.work
        self._call_s += time.perf_counter() - ticket.t0  # the CPU LoRA part on the step's critical path
        n = ticket.rows
        return self._y[: n * ticket.out_cols].view(n, ticket.out_cols)

    def _fail(self, ticket: Ticket, dead: _Helper | None, why: str) -> None:
        """Restart `dead`, let the others finish their share (so no late write lands in the
        regions after the next submit), and raise."""
        if dead is not None:
            self._restart(dead)
        for seq, (h, _, _) in list(ticket.pending.items()):
            if h is dead or h is not self._helpers[h.index]:
                continue
            try:
                deadline = time.monotonic() + self.hang_s
                while seq in ticket.pending:
                    if not h.conn.poll(0.05):
                        if not h.proc.is_alive() or time.monotonic() > deadline:
                            raise EOFError
                        continue
                    rec = self._recv(h)
                    if rec.kind is Kind.DONE:
                        ticket.pending.pop(rec.seq, None)
            except (EOFError, OSError, ValueError):
                self._restart(h)
        ticket.pending.clear()
        raise CpuLoRAFailed(why)

    def close(self) -> None:
        for h in self._helpers:
            try:
                h.conn.send_bytes(Record(Kind.SHUTDOWN).encode())
            except OSError:
                pass
        for h in self._helpers:
            h.proc.join(2)
            if h.proc.is_alive():
                h.proc.kill()
                h.proc.join(2)
            h.conn.close()
        if self._registered:
            torch.cuda.synchronize()  # no copy in flight into the regions
            for t in self._registered:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            self._registered.clear()
        del self._x, self._y, self._bell
        for shm in (self._shm_in, self._shm_out, self._shm_bell):
            try:
                shm.close()
            except BufferError:  # a view still exported: the mapping goes with the process
                pass
            shm.unlink()


__all__ = ["CpuLoRAFailed", "CpuLoRAHelpers", "Segment", "Ticket"]
