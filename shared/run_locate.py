"""Finding a running cluster from any folder: its state file, wherever `tidal up` was started.

`tidal up` keeps `<data_dir>/run.json`; a relative `data_dir` (the default `.tidal`) is relative to the
folder it started in, so from anywhere else the file is not where a client looks first. While it runs,
a per-user pointer to it lives under `$XDG_STATE_HOME/tidal/clusters/` (default `~/.local/state`),
written and removed with the state file (run_state.py). A client looks, in order:

1. `--state DIR` (the cluster's data directory), or else the `TIDAL_STATE` environment variable;
2. the data_dir of `--config FILE`, or of the default config, relative to the cwd;
3. the per-user pointers, keeping those whose launcher still runs: one is taken, several are named.

Whatever it finds or not, it says where it looked (`Located.looked`), for the message a user reads.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

STATE_ENV = "TIDAL_STATE"
STATE_FILE = "run.json"


def state_path(data_dir: str | os.PathLike[str]) -> Path:
    """The state file of a cluster whose data directory is `data_dir`."""
    return Path(data_dir) / STATE_FILE


class ClusterPointer(msgspec.Struct, kw_only=True):
    data_dir: str  # absolute
    launcher_pid: int
    launcher_create_time: float


def user_state_dir() -> Path:
    """Where this user's pointers to running clusters live."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tidal" / "clusters"


def pointer_path(data_dir: str | os.PathLike[str]) -> Path:
    key = hashlib.sha256(str(Path(data_dir).absolute()).encode()).hexdigest()[:16]
    return user_state_dir() / f"{key}.json"


def write_pointer(data_dir: str | os.PathLike[str], launcher_pid: int, launcher_create_time: float) -> None:
    """Best effort: a read-only home leaves the cluster findable by --state and from its own folder."""
    path = pointer_path(data_dir)
    pointer = ClusterPointer(data_dir=str(Path(data_dir).absolute()), launcher_pid=launcher_pid,
                             launcher_create_time=launcher_create_time)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.json.encode(pointer))
        os.replace(tmp, path)
    except OSError:
        pass


def remove_pointer(data_dir: str | os.PathLike[str]) -> None:
    try:
        pointer_path(data_dir).unlink(missing_ok=True)
    except OSError:
        pass


def _launcher_alive(pointer: ClusterPointer) -> bool:
    import psutil

    try:
        proc = psutil.Process(pointer.launcher_pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - pointer.launcher_create_time) < 0.5
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def live_pointers() -> list[ClusterPointer]:
    """This user's running clusters (pointers whose launcher is gone are removed on the way)."""
    found = []
    folder = user_state_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            pointer = msgspec.json.decode(path.read_bytes(), type=ClusterPointer)
        except (OSError, msgspec.MsgspecError):
            continue
        if _launcher_alive(pointer):
            found.append(pointer)
        else:
            path.unlink(missing_ok=True)
    return found


@dataclass
class Located:
    data_dir: Path | None  # the cluster's data directory (None: no running cluster found)
    looked: list[str] = field(default_factory=list)  # where, in words, in order
    ambiguous: list[str] = field(default_factory=list)  # several running clusters, none chosen

    def why_none(self) -> str:
        if self.ambiguous:
            return ("several Tidal clusters are running (" + ", ".join(self.ambiguous)
                    + "); choose one with --state DIR or TIDAL_STATE=DIR")
        return "no Tidal cluster is running: looked in " + "; ".join(self.looked)


def locate(explicit: str | os.PathLike[str] | None, config_data_dir: str | os.PathLike[str] | None, *,
           search_user: bool = True) -> Located:
    """The data directory of the running cluster a client means (see the module doc for the order).
    `explicit` is --state (or --data-dir); `config_data_dir` the data_dir of the config in use;
    `search_user` False when the user named the config (then only its cluster is meant)."""
    if explicit:
        path = Path(explicit).absolute()
        found = state_path(path).exists()
        return Located(path if found else None, [f"{state_path(path)} (--state)"])
    if os.environ.get(STATE_ENV):
        path = Path(os.environ[STATE_ENV]).absolute()
        found = state_path(path).exists()
        return Located(path if found else None, [f"{state_path(path)} ({STATE_ENV})"])
    looked = []
    if config_data_dir is not None:
        path = Path(config_data_dir).absolute()
        looked.append(str(state_path(path)))
        if state_path(path).exists():
            return Located(path, looked)
    if not search_user:
        return Located(None, looked)
    pointers = [p for p in live_pointers() if state_path(p.data_dir).exists()]
    looked.append(f"{user_state_dir()} ({len(pointers)} running cluster(s) of this user)")
    if len(pointers) == 1:
        return Located(Path(pointers[0].data_dir), looked)
    return Located(None, looked, ambiguous=[p.data_dir for p in pointers] if pointers else [])


__all__ = ["STATE_ENV", "STATE_FILE", "ClusterPointer", "Located", "live_pointers", "locate", "pointer_path", "remove_pointer",
           "state_path", "user_state_dir", "write_pointer"]
