"""The receiving process of `tidal bench transfer`: `python -m tidal.bench.transfer_receiver`.

It runs a DataPlane whose destinations are preallocated, pre-touched buffers (so no page
faults are measured), a raw ucxx listener for the one-message baseline (receive N bytes
into the same buffer, answer one byte), and — when nixl imports — a nixl agent with a KV
cache registered for one-sided writes. The parent drives it with JSON lines on stdin and
reads JSON lines on stdout; it exits when stdin closes.
"""
from __future__ import annotations

import asyncio
import base64
import os
import sys
from typing import Literal

import msgspec
import numpy as np

KV_BYTES = 1 << 30
ACT_BYTES = 64 << 20


class ReceiverReady(msgspec.Struct, kw_only=True, frozen=True):
    event: Literal["ready"] = "ready"
    address: str
    raw_port: int
    nixl: str  # "" when nixl is usable, else why not
    nixl_metadata_b64: str = ""
    nixl_cache_addr: int = 0


class BlockSet(msgspec.Struct, kw_only=True, frozen=True):
    """`n_blocks` blocks, chosen by `seed` among the cache's `n_total`, moved to the same ids."""

    n_total: int
    n_blocks: int
    block_bytes: int
    seed: int

    def ids(self) -> np.ndarray:
        return np.sort(np.random.default_rng(self.seed).choice(self.n_total, self.n_blocks, replace=False))

    def pattern(self) -> np.ndarray:
        return np.random.default_rng(self.seed + 1).integers(0, 256, self.n_total * self.block_bytes, dtype=np.uint8)


class ReceiverCommand(msgspec.Struct, kw_only=True, frozen=True):
    command: Literal["expect_blocks", "check_blocks", "trace_on", "trace_off"]
    blocks: BlockSet | None = None
    key: str = ""


class ReceiverReply(msgspec.Struct, kw_only=True, frozen=True):
    event: Literal["done"] = "done"
    ok: bool = True
    steps: list[tuple[str, int, int, float]] = []  # trace_off: the receiver's timeline (transfer/timeline.py)


def _emit(obj: msgspec.Struct) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


class NixlSide:
    """A nixl agent with `cache` (a host buffer) registered for one-sided reads and writes."""

    def __init__(self, name: str, cache: np.ndarray) -> None:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.cache = cache
        self.reg = self.agent.register_memory([(int(cache.ctypes.data), cache.nbytes, 0, "")], "DRAM")
        self.addr = int(cache.ctypes.data)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())


def nixl_side(name: str, cache: np.ndarray) -> tuple[NixlSide | None, str]:
    """(agent, "") or (None, why nixl cannot be used here)."""
    try:
        return NixlSide(name, cache), ""
    except ModuleNotFoundError as exc:
        return None, f"{exc} (install it with: pip install --no-deps nixl nixl-cu12)"
    except Exception as exc:  # noqa: BLE001 - report exactly why nixl is unusable here
        return None, f"{type(exc).__name__}: {exc}"


async def serve(cache_bytes: int) -> None:
    from services.gpu_worker.transfer import DataPlane, DataPlaneConfig, TrafficClass
    from services.gpu_worker.transfer import timeline
    from services.gpu_worker.transfer.sink import Sink

    kv_dest = np.empty(KV_BYTES, dtype=np.uint8)
    kv_dest.fill(0)
    act_dest = np.empty(ACT_BYTES, dtype=np.uint8)
    act_dest.fill(0)
    plane = DataPlane("bench-receiver", config=DataPlaneConfig())
    plane.inbox.on_kind(TrafficClass.KV, lambda s, _p: Sink(s.key, kv_dest[: s.total_bytes]))
    plane.inbox.on_kind(TrafficClass.WEIGHTS, lambda s, _p: Sink(s.key, kv_dest[: s.total_bytes]))
    plane.inbox.on_kind(TrafficClass.ACTIVATION, lambda s, _p: Sink(s.key, act_dest[: s.total_bytes]))
    await plane.start()
    ucxx = plane._runtime()

    async def raw_handler(ep: object) -> None:
        """Per message: [total, chunk] (int64), then the bytes — one message, or total/chunk
        messages of `chunk` bytes, all received into place — then a 1-byte answer."""
        ctl = np.empty(2, dtype=np.int64)
        ack = np.ones(1, dtype=np.uint8)
        try:
            while True:
                await ep.recv(ctl)  # type: ignore[attr-defined]
                n, chunk = int(ctl[0]), int(ctl[1]) or int(ctl[0])
                dest = (act_dest if n <= ACT_BYTES else kv_dest)[:n]  # activations land apart from the bulk
                await asyncio.gather(*(ep.recv(dest[o:o + chunk]) for o in range(0, max(n, 1), chunk)))  # type: ignore[attr-defined]
                await ep.send(ack)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the sender closed the raw endpoint
            return

    raw = ucxx.create_listener(raw_handler)
    cache = np.empty(cache_bytes, dtype=np.uint8)
    cache.fill(0)
    nixl, why = nixl_side("receiver", cache) if cache_bytes else (None, "not requested")
    _emit(ReceiverReady(
        address=plane.address, raw_port=raw.port, nixl=why,
        nixl_metadata_b64=base64.b64encode(nixl.metadata()).decode() if nixl else "",
        nixl_cache_addr=nixl.addr if nixl else 0,
    ))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = msgspec.json.decode(line, type=ReceiverCommand)
        if cmd.command == "trace_on":
            timeline.enable()
            _emit(ReceiverReply())
            continue
        if cmd.command == "trace_off":
            _emit(ReceiverReply(steps=timeline.disable()))
            continue
        b = cmd.blocks
        assert b is not None
        blocks = cache[: b.n_total * b.block_bytes].reshape(b.n_total, b.block_bytes)
        if cmd.command == "expect_blocks":  # the data plane receives straight into the blocks
            plane.inbox.expect(cmd.key, [blocks[i] for i in b.ids()])
            _emit(ReceiverReply())
        else:
            ids = b.ids()
            ok = bool((blocks[ids] == b.pattern().reshape(b.n_total, b.block_bytes)[ids]).all())
            cache.fill(0)  # the next round must write everything again
            _emit(ReceiverReply(ok=ok))
    os._exit(0)  # stdin closed: the bench is over


def main() -> None:
    from shared.logging import configure_logging

    configure_logging("bench-receiver", level=os.environ.get("TIDAL_LOG_LEVEL", "warning"))
    cache_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    asyncio.run(serve(cache_bytes))


if __name__ == "__main__":
    main()
