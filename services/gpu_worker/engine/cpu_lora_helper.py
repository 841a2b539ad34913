"""A CPU LoRA helper process (CaraServe §4.1): maps the worker's host copies of adapters, computes x·A·B.

Started by `CpuLoRAHelpers` with the "spawn" context (a fresh interpreter: no fork of the
threaded worker), pinned to its core when given one. It maps the two shared regions and, on
REGISTER, the adapter's shared host copy (`lora_shared`: the engine's own A and B·scale, bit for
bit, in one file for every helper; no directory is read), and answers COMPUTE records: rows of the input region times the
adapter's A then B, written into its rows of the output region. One core, one thread: the
parallelism is across helpers (§4.2). It exits when the engine's end of the pipe closes. A COMPUTE record may arrive before its
input rows (the sync-free invocation): the helper waits for the shared doorbell to reach the
record's gate before it reads them.

`pace` (seconds per cold row x rank of a call; 0: none) stretches each call to at least that
long: a stand-in for a slower CPU, so a bench can give CPU LoRA the share of a prefill it has on
another machine (`tidal bench lora --cpu-ratio`). It sleeps, so it is faithful in time, not in
the core it would have kept busy. Like `lora_load_bandwidth`, a simulation, not a measurement.
"""
from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import torch

from .cpu_lora_wire import GROUPS, Kind, Record, Status, decode, group_layout
from .lora_shared import SharedLayout, attach
from .model_config import load_model_config

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

PROFILE_ROWS, PROFILE_RANK, PROFILE_DIM = 64, 16, 512
GATE_TIMEOUT_S = 30.0  # the engine's rows never landed: answer ERROR (the engine falls back)


def _attach(name: str) -> SharedMemory:
    # Spawned children share the engine's resource tracker, where the name is registered
    # already (a set: attaching adds nothing); the engine unlinks it. Never unregister here.
    return SharedMemory(name=name)


def _profile() -> float:
    """Row x rank products per second of one shrink+expand at a typical shape (the first plan's guess)."""
    x = torch.randn(PROFILE_ROWS, PROFILE_DIM)
    a, b = torch.randn(PROFILE_RANK, PROFILE_DIM), torch.randn(PROFILE_DIM, PROFILE_RANK)
    (x @ a.t()) @ b.t()  # warm-up
    t0 = time.perf_counter()
    for _ in range(5):
        (x @ a.t()) @ b.t()
    return 5 * PROFILE_ROWS * PROFILE_RANK / max(time.perf_counter() - t0, 1e-9)


def wait_for_gate(bell: memoryview, gate: int, timeout_s: float = GATE_TIMEOUT_S) -> bool:
    """Spin until the doorbell reads >= `gate` (the engine's rows have landed); False on timeout."""
    if bell[0] >= gate:
        return True
    deadline = time.monotonic() + timeout_s
    spins = 0
    while bell[0] < gate:
        spins += 1
        if spins > 1000:  # past ~a few µs of spinning, yield the core
            time.sleep(0)
            if time.monotonic() > deadline:
                return False
    return True


def helper_main(conn: Connection, in_name: str, out_name: str, bell_name: str, model_dir: str, dtype: str | None,
                layer_start: int, layer_stop: int, core: int = -1, pace: float = 0.0) -> None:
    if core >= 0 and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {core})
        except OSError:  # not in this process's cpuset: run where allowed
            pass
    torch.set_num_threads(1)
    cfg = load_model_config(model_dir, dtype)
    shm_in, shm_out, shm_bell = _attach(in_name), _attach(out_name), _attach(bell_name)
    bell = shm_bell.buf.cast("q")
    x_region = torch.frombuffer(shm_in.buf, dtype=cfg.dtype)
    y_region = torch.frombuffer(shm_out.buf, dtype=cfg.dtype)
    try:
        _serve(conn, cfg, bell, x_region, y_region, range(layer_start, layer_stop), pace)
    finally:
        bell.release()  # no exported view may outlive the mapping at exit


def _serve(conn: Connection, cfg, bell: memoryview, x_region: torch.Tensor, y_region: torch.Tensor,  # type: ignore[no-untyped-def]
           layers: range, pace: float = 0.0) -> None:
    layouts = [group_layout(cfg, g) for g in range(len(GROUPS))]
    adapters: dict[int, Weights | None] = {}
    conn.send_bytes(Record(Kind.READY, value=_profile()).encode())
    while True:
        try:
            rec = decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if rec.kind is Kind.SHUTDOWN:
            return
        if rec.kind is Kind.REGISTER:
            try:
                adapters[rec.adapter] = attach(SharedLayout.decode(rec.path))
            except Exception:  # noqa: BLE001 - reported on use: COMPUTE answers UNKNOWN_ADAPTER
                adapters[rec.adapter] = None
        elif rec.kind is Kind.UNREGISTER:
            adapters.pop(rec.adapter, None)
        elif rec.kind is Kind.COMPUTE:
            if not wait_for_gate(bell, rec.gate):
                conn.send_bytes(Record(Kind.DONE, seq=rec.seq, status=Status.ERROR).encode())
                continue
            t0 = time.perf_counter()
            adapter = adapters.get(rec.adapter)
            status = _compute(rec, adapter, layouts, x_region, y_region)
            if pace > 0 and status == Status.OK and adapter:
                rank = next(iter(adapter.values()))[0].shape[0]
                time.sleep(max(0.0, rec.count * rank * pace - (time.perf_counter() - t0)))
            conn.send_bytes(Record(Kind.DONE, seq=rec.seq, status=status, value=time.perf_counter() - t0).encode())


def _compute(rec: Record, adapter: Weights | None, layouts: list, x_region: torch.Tensor,
             y_region: torch.Tensor) -> int:
    if adapter is None:
        return Status.UNKNOWN_ADAPTER
    in_dim, cols = layouts[rec.group]
    out_cols = sum(w for _, _, w in cols)
    if rec.in_dim != in_dim or rec.out_cols != out_cols:
        return Status.ERROR  # the engine's layout differs: refuse rather than compute garbage
    end = rec.row + rec.count
    x = x_region[: end * in_dim].view(end, in_dim)[rec.row:]
    y = y_region[: end * out_cols].view(end, out_cols)[rec.row:]
    with torch.inference_mode():
        for target, at, width in cols:
            ab = adapter.get((rec.layer, target))
            if ab is None:
                y[:, at:at + width].zero_()
            else:
                y[:, at:at + width].copy_((x @ ab[0].t()) @ ab[1].t())
    return Status.OK
