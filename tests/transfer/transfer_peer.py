"""A probe-peer process (services.gpu_worker.transfer.probe_peer) driven from a test."""
from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading

import msgspec

from services.gpu_worker.transfer.probe_peer import PeerEvent


class PeerProcess:
    """A separate process with its own UCX worker, listening on loopback; reports transfers."""

    def __init__(self, *flags: str, peer_id: str = "peer") -> None:
        self.peer_id = peer_id
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.gpu_worker.transfer.probe_peer", "--id", peer_id, *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._events: queue.Queue[PeerEvent] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._events.get(timeout=60)
        assert ready.event == "ready", ready
        self.address = ready.address

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):  # UCX itself may print warnings on stdout
                self._events.put(msgspec.json.decode(line, type=PeerEvent))

    async def next_event(self, timeout: float = 30.0) -> PeerEvent:
        return await asyncio.to_thread(self._events.get, True, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the peer exits when its stdin closes
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
