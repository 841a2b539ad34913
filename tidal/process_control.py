"""Signals to whole process groups, and liveness checks that survive pid reuse.

Every child of `tidal up` runs in its own session (its own process group), so that Ctrl-C in
the terminal reaches only the launcher, which then stops the children in order, and so that
anything a child spawns (e.g. CPU LoRA helper processes) is stopped with it.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Iterable

import psutil

from shared.run_state import ProcessInfo


def create_time(pid: int) -> float:
    """The process's start time (psutil), 0.0 if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0


def pid_alive(pid: int, created: float | None = None) -> bool:
    """True if `pid` runs (and, given `created`, is the same process, not a recycled pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return created is None or abs(proc.create_time() - created) < 0.5
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group `pgid`."""
    try:
        os.killpg(pgid, 0)  # cheap: fails when the group is empty
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied, PermissionError):
            continue
    return False


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send `sig` to a process group; False when the group is already empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def recorded_alive(info: ProcessInfo) -> bool:
    """The recorded process itself, or anything left in its process group, still runs."""
    if pid_alive(info.pid, info.create_time):
        return True
    return info.pgid > 1 and info.pgid != os.getpgid(0) and group_alive(info.pgid)


def stop_recorded(
    procs: Iterable[ProcessInfo], *, grace_s: float, poll_s: float = 0.1, hurry: threading.Event | None = None
) -> list[ProcessInfo]:
    """SIGTERM each recorded process group, wait up to `grace_s` for all to exit (less if
    `hurry` is set meanwhile), SIGKILL the rest. Returns those still alive afterwards (none,
    unless a process ignores SIGKILL)."""
    procs = [p for p in procs if recorded_alive(p)]
    for info in procs:
        if info.pgid > 1 and info.pgid != os.getpgid(0):
            signal_group(info.pgid, signal.SIGTERM)
        elif pid_alive(info.pid, info.create_time):
            os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while procs and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
        procs = [p for p in procs if recorded_alive(p)]
        time.sleep(poll_s)
    for info in procs:
        if info.pgid > 1 and info.pgid != os.getpgid(0):
            signal_group(info.pgid, signal.SIGKILL)
        elif pid_alive(info.pid, info.create_time):
            os.kill(info.pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while procs and time.monotonic() < end:
        procs = [p for p in procs if recorded_alive(p)]
        time.sleep(poll_s)
    return procs
