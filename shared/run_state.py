"""The state file of a running cluster: `<data_dir>/run.json`, written by `tidal up`.

It tells `tidal down` and `tidal status` where the cluster is (NATS url) and which processes
belong to it (pid, process group, start time — the start time guards against a recycled pid).
Written atomically (temp file + rename) on every change; removed when `tidal up` exits. A per-user
pointer to it is kept alongside (run_locate.py), so a client finds the cluster from any folder.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from shared.run_locate import STATE_FILE, remove_pointer, state_path, write_pointer


class ProcessInfo(msgspec.Struct, kw_only=True):
    name: str  # "nats", "registry", "gateway", ..., "gpu_worker"
    instance: str  # the service instance id ("" for nats)
    kind: Literal["nats", "service"]
    pid: int
    pgid: int
    create_time: float  # psutil's process start time, to tell a recycled pid apart
    log: str
    worker_id: str | None = None
    restarts: int = 0


class RunState(msgspec.Struct, kw_only=True):
    launcher_pid: int
    launcher_create_time: float
    nats_url: str
    embedded_nats: bool
    data_dir: str
    config: str | None  # the --config file, None for the embedded default
    gateway_url: str
    started_ts: float
    ready: bool = False  # every service answered health (set once, after start-up)
    processes: list[ProcessInfo] = []

    def services(self) -> list[ProcessInfo]:
        return [p for p in self.processes if p.kind == "service"]

    def nats(self) -> ProcessInfo | None:
        return next((p for p in self.processes if p.kind == "nats"), None)


def read_state(data_dir: str | os.PathLike[str]) -> RunState | None:
    """The recorded run, or None when there is none. A corrupt file raises ValueError."""
    path = state_path(data_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=RunState)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"{path}: not a valid Tidal state file ({exc}); remove it if no cluster is running") from exc


def write_state(state: RunState) -> Path:
    path = state_path(state.data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
    tmp.touch(mode=0o600)  # its NATS URL carries the operator's password
    tmp.chmod(0o600)
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=2) + b"\n")
    os.replace(tmp, path)
    write_pointer(state.data_dir, state.launcher_pid, state.launcher_create_time)
    return path


def remove_state(data_dir: str | os.PathLike[str], *, launcher_pid: int | None = None) -> None:
    """Remove the state file (only if it is still ours, when `launcher_pid` is given)."""
    path = state_path(data_dir)
    if launcher_pid is not None:
        try:
            current = read_state(data_dir)
        except ValueError:
            current = None
        if current is not None and current.launcher_pid != launcher_pid:
            return
    path.unlink(missing_ok=True)
    remove_pointer(data_dir)
