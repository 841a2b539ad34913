"""`tidal up` waiting for its services, and why one did not start, from its log (not only the log's path).

`wait_healthy` waits for every child's `ready`, printing the progress a starting one reports.

A service logs JSON lines (structlog: `event`, `level`, fields) and anything else a library or
the interpreter writes goes to the same file as plain text (a traceback, a compiler's error).
Only the current run counts: the lines after the launcher's last `--- tidal up: starting` marker.
The cause is that run's error and critical entries (event and `error` field) and the plain-text
lines that carry an error (a traceback's last line, `error:` from a compiler); when there is none,
the last lines as they are.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from shared.bus import Bus
from tidal.health_probe import gather_health


class Starting(Protocol):
    """What waiting needs of a launcher child (tidal.launcher.Child)."""

    spec: Any  # its ChildSpec: label, name, log_path
    proc: Any

    @property
    def instance(self) -> str: ...

    def exited(self) -> int | None: ...

    def cpu_seconds(self) -> float: ...

MARKER = "--- tidal up: starting"
STALLED_S = 900.0  # a service answering `starting` with the same progress this long is stuck, not slow
_ERROR_WORDS = ("error", "exception", "traceback", "failed", "fatal", "killed", "interrupted")


def _current_run(text: str) -> list[str]:
    lines = text.splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith(MARKER)), default=-1)
    return [line for line in lines[start + 1:] if line.strip()]


def _entry(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _describe(entry: dict) -> str:
    fields = [f"{k}={entry[k]}" for k in ("error", "model", "worker_id", "exc_info", "exception") if k in entry]
    return " ".join([str(entry.get("event", "")), *fields]).strip()


def failure_cause(log_path: Path, *, limit: int = 8) -> str:
    """The lines of `log_path`'s current run that say what went wrong (at most `limit`), one per line."""
    try:
        lines = _current_run(log_path.read_text(errors="replace"))
    except OSError as exc:
        return f"(cannot read {log_path}: {exc.strerror or exc})"
    if not lines:
        return "(its log is empty: it has written nothing in this run)"
    found: list[str] = []
    for line in lines:
        entry = _entry(line)
        if entry is not None:
            if str(entry.get("level", "")).lower() in ("error", "critical"):
                found.append(_describe(entry))
        elif any(word in line.lower() for word in _ERROR_WORDS):
            found.append(line.strip())
    picked = found[-limit:] if found else lines[-limit:]
    return "\n".join(f"    {line[:400]}" for line in picked)


def last_progress(log_path: Path) -> str | None:
    """The last `progress` a service logged in its current run (what it was doing when it went quiet)."""
    try:
        lines = _current_run(log_path.read_text(errors="replace"))
    except OSError:
        return None
    for line in reversed(lines):
        entry = _entry(line)
        if entry is not None and entry.get("progress"):
            return str(entry["progress"])
    return None


async def wait_healthy(bus: Bus, children: list[Starting], wait_s: float, stop: asyncio.Event,
                       out: Callable[[str], None]) -> bool:
    """Until every child answers `ready`. A child that answers `starting` (with its progress, printed when it
    changes) is waited for as long as it keeps answering, and one not answering yet as long as it keeps using
    the CPU (importing torch takes a minute on a busy 2-core box); one silent and idle for `wait_s`, or stuck on
    one progress for STALLED_S, fails the start with the cause from its log."""
    heard = {c.instance: time.monotonic() for c in children}  # the start counts as heard: wait_s of silence
    progress: dict[str, tuple[str, float]] = {}
    cpu = {c.instance: 0.0 for c in children}  # CPU seconds at the last silence check
    waiting = {c.instance: c for c in children}
    while waiting:
        for instance, child in list(waiting.items()):
            code = child.exited()
            if code is not None:
                out(f"tidal: {child.spec.label} exited with code {code} during start-up "
                    f"(log: {child.spec.log_path}); the cause:\n{failure_cause(child.spec.log_path)}")
                return False
        if stop.is_set():
            return False
        now = time.monotonic()
        for i, c in waiting.items():
            if now - heard[i] > wait_s and c.cpu_seconds() > cpu[i] + 0.5:  # silent, but working
                cpu[i], heard[i] = c.cpu_seconds(), now
                if i not in progress:
                    progress[i] = ("working, not answering health yet", now)
                    out(f"tidal: {c.spec.label} starting: no health reply yet, but working "
                        f"({cpu[i]:.0f}s of CPU so far); waiting")
        silent = [c for i, c in waiting.items() if now - heard[i] > wait_s]
        stalled = [c for i, c in waiting.items() if i in progress and now - progress[i][1] > STALLED_S]
        if silent or stalled:
            for child in silent + stalled:
                what = progress.get(child.instance, ("", 0.0))[0] or last_progress(child.spec.log_path)
                why = (f"no health reply and no CPU use for {wait_s:.0f}s" if child in silent
                       else f"no progress for {STALLED_S:.0f}s")
                out(f"tidal: {child.spec.label}: {why}" + (f" (last: {what})" if what else "")
                    + f"; its log ({child.spec.log_path}) says:\n{failure_cause(child.spec.log_path)}")
            return False
        for service in {c.spec.name for c in waiting.values()}:
            # a busy host may take a while to answer: a late reply must not count as silence
            replies = await gather_health(bus, service, timeout=1.0, expect=set(waiting))
            for instance, reply in replies.items():
                if instance not in waiting:
                    continue
                heard[instance] = time.monotonic()
                if reply.state == "ready":
                    out(f"tidal: {waiting[instance].spec.label} ready ({instance}, pid {waiting[instance].proc.pid})")  # type: ignore[union-attr]
                    del waiting[instance]
                elif reply.progress and reply.progress != progress.get(instance, ("", 0.0))[0]:
                    progress[instance] = (reply.progress, heard[instance])
                    out(f"tidal: {waiting[instance].spec.label} starting: {reply.progress}")
        await asyncio.sleep(0.1)
    return True


__all__ = ["MARKER", "STALLED_S", "failure_cause", "last_progress", "wait_healthy"]
