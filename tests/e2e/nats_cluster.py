"""A three-node NATS cluster with JetStream (real nats-server processes, routes on loopback), as
compose/docker-compose.yml runs it: each node its own store, `server_name`, one cluster `tidal`.

Clients connect to one node and learn the others from it (the server's INFO `connect_urls`): when
that node dies they reconnect to another on their own.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import nats

from shared.nats_server import NatsServer, free_port

NODES = 3


class NatsCluster:
    def __init__(self, root: Path, nodes: int = NODES) -> None:
        routes = [free_port() for _ in range(nodes)]
        table = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in routes)
        self.nodes = [
            NatsServer(store_dir=root / f"n{i}", extra_config=(
                f'server_name: "n{i}"\n'
                f'cluster {{\n  name: "tidal"\n  listen: "127.0.0.1:{routes[i]}"\n  routes: [{table}]\n}}\n'))
            for i in range(nodes)
        ]

    def start(self, timeout_s: float = 60.0) -> "NatsCluster":
        for node in self.nodes:
            node.start()
        asyncio.run(self._wait_for_jetstream(timeout_s))
        return self

    async def _wait_for_jetstream(self, timeout_s: float) -> None:
        """Until every node answers JetStream requests (routes up, a meta leader elected)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            nc = await nats.connect(node.url)
            try:
                while True:
                    try:
                        await nc.jetstream().account_info()
                        break
                    except Exception:  # noqa: BLE001 - not ready yet, whatever the error
                        assert time.monotonic() < deadline, f"JetStream of {node.url} not ready in {timeout_s}s"
                        await asyncio.sleep(0.2)
            finally:
                await nc.close()

    def url_of(self, name: str) -> str:
        return self.nodes[int(name.removeprefix("n"))].url

    def kill(self, name: str) -> None:
        """SIGKILL a node (no clean shutdown: as a host that dies)."""
        node = self.nodes[int(name.removeprefix("n"))]
        assert node.proc is not None
        os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(10)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


async def stream_leader(nc: nats.NATS, stream: str) -> str:
    info = await nc.jetstream().stream_info(stream)
    assert info.cluster is not None and info.cluster.leader, info
    return info.cluster.leader


async def move_leader(nc: nats.NATS, stream: str, to: str, timeout_s: float = 30.0) -> None:
    """Ask `stream`'s leader to step down until `to` leads it (the new leader is the replicas' choice)."""
    deadline = time.monotonic() + timeout_s
    while (leader := await stream_leader(nc, stream)) != to:
        assert time.monotonic() < deadline, f"{stream}: leader stays {leader}, not {to}"
        try:
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        except Exception:  # noqa: BLE001 - an election in progress; ask again
            pass
        await asyncio.sleep(0.5)
