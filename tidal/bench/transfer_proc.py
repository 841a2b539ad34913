"""The bench's handle on its receiver process (tidal.bench.transfer_receiver)."""
from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading

import msgspec

from tidal.bench.transfer_receiver import ReceiverCommand, ReceiverReady, ReceiverReply


class ReceiverProcess:
    def __init__(self, cache_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.bench.transfer_receiver", str(cache_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = msgspec.json.decode(self._lines.get(timeout=120), type=ReceiverReady)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):  # UCX may print its own warnings on stdout
                self._lines.put(line)

    async def command(self, cmd: ReceiverCommand) -> ReceiverReply:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(cmd).decode() + "\n")
        self.proc.stdin.flush()
        line = await asyncio.to_thread(self._lines.get, True, 120)
        return msgspec.json.decode(line, type=ReceiverReply)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
