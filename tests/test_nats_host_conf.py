"""`tidal nats-config` (shared/nats_host_conf.py): a NATS of your own for several hosts. A three-node
cluster from three runs of the command with the same --out: the nodes share the users, their routes
authenticate, JetStream elects a leader, and a role connects with its credentials file (all three
nodes in its URL); monitoring is off unless asked for."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from service_procs import ROOT
from shared.nats_credentials import read_credentials
from shared.nats_server import free_port, nats_server_binary
from shared.subjects import ROLES

pytestmark = pytest.mark.timeout(120)


def nats_config(out: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tidal", "nats-config", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


PORT_TRIES = 3  # a port free_port() handed out may be taken before the node binds it: new ports, new configs


def start_nodes(out: Path) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """Three nodes from three runs of `tidal nats-config` into `out`; returns the client URL and the
    processes, every node listening (its log says so: a connection to its port could reach another's)."""
    clients, routes = [free_port() for _ in range(3)], [free_port() for _ in range(3)]
    table = ",".join(f"127.0.0.1:{port}" for port in routes)
    url = ",".join(f"nats://127.0.0.1:{port}" for port in clients)
    for i in range(3):
        nats_config(out, "--url", url, "--node", f"n{i}", "--routes", table, "--listen",
                    f"127.0.0.1:{clients[i]}", "--cluster-listen", f"127.0.0.1:{routes[i]}")
    procs = []
    for i in range(3):
        with (out / f"n{i}.log").open("wb") as log:  # (the node keeps its own descriptor)
            procs.append(subprocess.Popen([nats_server_binary(), "-c", str(out / f"nats-n{i}.conf")],
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 30
    waiting = set(range(3))
    while waiting:
        for i in sorted(waiting):
            if procs[i].poll() is not None:
                stop(procs)
                raise NodeExited((out / f"n{i}.log").read_text(errors="replace"))
            if "Server is ready" in (out / f"n{i}.log").read_text(errors="replace"):  # (listening, its own port)
                waiting.discard(i)
        if waiting:
            if time.monotonic() > deadline:
                stop(procs)
                raise AssertionError(f"nodes {sorted(waiting)} never listened")
            time.sleep(0.1)
    return url, procs


class NodeExited(Exception):
    """A node exited while starting; its log is the message."""


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


async def test_a_three_node_cluster_from_the_written_configs(tmp_path: Path) -> None:
    for attempt in range(PORT_TRIES):
        out = tmp_path / f"try{attempt}"
        try:
            url, procs = start_nodes(out)
            break
        except NodeExited as exc:
            if "address already in use" not in str(exc) or attempt == PORT_TRIES - 1:
                raise AssertionError(f"a node exited while starting:\n{exc}") from None
    confs = [(out / f"nats-n{i}.conf").read_text() for i in range(3)]
    assert all(c.count("password:") == confs[0].count("password:") for c in confs)  # the same users everywhere
    assert all("http:" not in c for c in confs)  # no monitoring endpoint
    assert {p.stem for p in (out / "credentials").glob("*.toml")} == {*ROLES, "operator", "route"}
    assert all(p.stat().st_mode & 0o077 == 0 for p in (out / "credentials").glob("*.toml"))
    try:
        operator = read_credentials(out / "credentials" / "operator.toml")
        assert operator.url == url
        # one try per call (nats.py would otherwise retry a refused server 60 times, 2 s apart)
        nc = await nats.connect(operator.url_with().split(",")[0], connect_timeout=2, allow_reconnect=False,
                                max_reconnect_attempts=0)
        deadline = time.monotonic() + 60
        try:
            while True:  # JetStream answers once the routes are up and a meta leader is elected
                try:
                    info = await nc.jetstream(timeout=2).account_info()
                    break
                except Exception:  # noqa: BLE001
                    assert time.monotonic() < deadline, "no JetStream leader: the routes did not form"
                    await asyncio.sleep(0.3)
            assert info is not None
            kv = await nc.jetstream(timeout=5).create_key_value(bucket="probe", replicas=3)  # needs all 3 nodes
            assert await kv.put("k", b"v") >= 1
        finally:
            await nc.close()
    finally:
        stop(procs)
