"""Why a service did not start, from its log: what `tidal up` prints instead of only the log's path.

A service logs JSON lines (structlog: `event`, `level`, fields) and anything else a library or
the interpreter writes goes to the same file as plain text (a traceback, a compiler's error).
Only the current run counts: the lines after the launcher's last `--- tidal up: starting` marker.
The cause is that run's error and critical entries (event and `error` field) and the plain-text
lines that carry an error (a traceback's last line, `error:` from a compiler); when there is none,
the last lines as they are.
"""
from __future__ import annotations

import json
from pathlib import Path

MARKER = "--- tidal up: starting"
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
        return "(its log is empty: it wrote nothing before it stopped)"
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


__all__ = ["MARKER", "failure_cause", "last_progress"]
