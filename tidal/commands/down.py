"""`tidal down [--config FILE | --state DIR]`: stop a cluster `tidal up` started (found as cluster_lookup.py says).

Asks the launcher to stop (SIGTERM: services drain, then NATS), waits for it, then makes sure
every recorded process group is gone — stopping any left over itself (when the launcher had
been killed) — and exits 0 only when none is left.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from tidal.commands.cluster_lookup import add_lookup_arguments, find_cluster
from tidal.launch_plan import DEFAULT_DRAIN_S
from tidal.process_control import pid_alive, recorded_alive, stop_recorded
from shared.run_state import read_state, remove_state, state_path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("down", help="stop the cluster started by `tidal up` (no process is left behind)")
    add_lookup_arguments(parser)
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long to wait for the launcher to stop everything (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    data_dir = find_cluster(args, "down")
    if isinstance(data_dir, int):
        return data_dir
    try:
        state = read_state(data_dir)
    except ValueError as exc:
        print(f"tidal down: {exc}", file=sys.stderr)
        return 1
    if state is None:
        print(f"tidal down: no Tidal cluster is running from {data_dir} (no {state_path(data_dir).name})",
              file=sys.stderr)
        return 1
    if pid_alive(state.launcher_pid, state.launcher_create_time):
        print(f"tidal down: stopping the cluster (launcher pid {state.launcher_pid})", flush=True)
        os.kill(state.launcher_pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while pid_alive(state.launcher_pid, state.launcher_create_time) and time.monotonic() < deadline:
            time.sleep(0.1)
        latest = read_state(data_dir) if state_path(data_dir).exists() else None
        if latest is not None and latest.launcher_pid == state.launcher_pid:
            state = latest  # it may have restarted children since we read it
    leftovers = [p for p in state.processes if recorded_alive(p)]
    if leftovers:
        print(f"tidal down: stopping {len(leftovers)} process(es) the launcher left: "
              + ", ".join(f"{p.name} pid {p.pid}" for p in leftovers), flush=True)
        services = [p for p in leftovers if p.kind == "service"]
        nats = [p for p in leftovers if p.kind == "nats"]
        stop_recorded([p for p in services if p.name != "registry"], grace_s=DEFAULT_DRAIN_S + 5)
        stop_recorded([p for p in services if p.name == "registry"], grace_s=DEFAULT_DRAIN_S + 5)
        stop_recorded(nats, grace_s=10.0)
    still = [p for p in state.processes if recorded_alive(p)]
    if pid_alive(state.launcher_pid, state.launcher_create_time):
        os.kill(state.launcher_pid, signal.SIGKILL)
    if still:
        print("tidal down: could not stop: " + ", ".join(f"{p.name} pid {p.pid}" for p in still), file=sys.stderr)
        return 1
    remove_state(data_dir)
    print("tidal down: stopped; no process left")
    return 0
