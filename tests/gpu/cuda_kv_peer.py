"""The other process of tests/gpu/test_cuda_dataplane.py: an engine on a device and a data plane.

    python tests/gpu/cuda_kv_peer.py --model DIR --device cuda:0 --chunk 8192

Reads one JSON command per line on stdin, writes one JSON event per line on stdout (first
`ready` with its data-plane address). Exits when stdin closes. Commands:

* `reserve` {rid, tokens, key}: KV blocks for `tokens` tokens of request `rid` (not running
  here), and expect transfer `key` into them (`kv_views`: the device cache itself).
* `expect` {key, nbytes, where}: expect `key` into a fresh buffer, "device" or "host".
* each of those reports `received` {key, nbytes, chunks, sha256 of the destination's bytes}
  or `failed` {key, reason}.
* `send` {key, to, seed, nbytes, where}: send `nbytes` random bytes (from `seed`) in device or
  host memory to the data plane at address `to`; reports `sent` {key, sha256}.
* `attach` {rid, prompt, outputs, computed, max_tokens}: admit the request on its reserved KV,
  decode it greedily to the end; reports `done` {rid, tokens}.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import threading
from typing import Any

import numpy as np
import torch

from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, Sink, TrafficClass

ENGINE = dict(pool_bytes=64 << 20, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def host_bytes(buffers: Any) -> list[np.ndarray]:
    out = []
    for b in buffers if isinstance(buffers, list) else [buffers]:
        if isinstance(b, torch.Tensor):
            b = b.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        out.append(b)
    return out


def sha256(buffers: Any) -> str:
    h = hashlib.sha256()
    for b in host_bytes(buffers):
        h.update(b)
    return h.hexdigest()


def random_buffer(seed: int, nbytes: int, where: str, device: str) -> Any:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return torch.from_numpy(data).to(device) if where == "device" else data


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.device = args.device
        self.engine = LLMEngine(EngineConfig(args.model, device=args.device, **ENGINE))
        chunking = ChunkingConfig(min_chunk=args.chunk, max_chunk=args.chunk)
        self.plane = DataPlane("peer", config=DataPlaneConfig(chunking=chunking, ucx_tls=None))

    def watch(self, sink: Sink, key: str) -> None:
        def report(fut: asyncio.Future) -> None:  # type: ignore[type-arg]
            if fut.cancelled():
                return
            error = fut.exception()
            if error is not None:
                emit(event="failed", key=key, reason=getattr(error, "reason", repr(error)))
            else:
                emit(event="received", key=key, nbytes=sink.segments.total, chunks=fut.result().chunks,
                     sha256=sha256(sink.buffers))

        sink._done.add_done_callback(report)

    async def handle(self, cmd: dict[str, Any]) -> None:
        op = cmd["cmd"]
        if op == "reserve":
            tables = self.engine.reserve_kv(cmd["rid"], cmd["tokens"])
            assert tables is not None, "no KV blocks"
            nblocks = min(len(t) for t in tables.values())
            views = self.engine.kv_views(cmd["rid"], 0, nblocks)
            self.watch(self.plane.inbox.expect(cmd["key"], views), cmd["key"])
            emit(event="expecting", key=cmd["key"], nbytes=sum(v.numel() * v.element_size() for v in views),
                 device=str(views[0].device))
        elif op == "expect":
            n, key = cmd["nbytes"], cmd["key"]
            buffer = torch.zeros(n, dtype=torch.uint8, device=self.device) if cmd["where"] == "device" else \
                np.zeros(n, dtype=np.uint8)
            self.watch(self.plane.inbox.expect(key, buffer), key)
            emit(event="expecting", key=key, nbytes=n, device=str(getattr(buffer, "device", "cpu")))
        elif op == "send":
            data = random_buffer(cmd["seed"], cmd["nbytes"], cmd["where"], self.device)
            link = await self.plane.link(cmd["to"], cmd["to"])
            kind = TrafficClass[cmd.get("kind", "KV")]
            receipt = await link.send(data, kind=kind, key=cmd["key"], timeout=60)
            emit(event="sent", key=cmd["key"], chunks=receipt.chunks, sha256=sha256(data))
        elif op == "attach":
            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            self.engine.attach(cmd["rid"], cmd["prompt"], params, output_token_ids=cmd["outputs"],
                               num_computed_tokens=cmd["computed"])
            tokens: list[int] = []
            while self.engine.has_unfinished:
                for o in self.engine.step():
                    tokens += o.new_token_ids
            emit(event="done", rid=cmd["rid"], tokens=tokens)
        else:
            raise ValueError(f"unknown command {op!r}")

    async def run(self) -> None:
        await self.plane.start()
        emit(event="ready", address=self.plane.address)
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str | None] = asyncio.Queue()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

        threading.Thread(target=read, daemon=True).start()
        while (line := await lines.get()) is not None:
            if line.strip():
                cmd = json.loads(line)
                try:
                    await self.handle(cmd)
                except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
                    emit(event="error", cmd=cmd.get("cmd"), key=cmd.get("key", ""), error=repr(exc))
        await self.plane.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.cuda.init()  # a CUDA context before UCX starts (its CUDA transports use it)
        torch.empty(1, device=args.device)
    asyncio.run(Peer(args).run())
    os._exit(0)  # UCX's threads must not keep the process alive


if __name__ == "__main__":
    main()
