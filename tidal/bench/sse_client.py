"""A minimal streaming HTTP/1.1 client for benchmarks: one POST, SSE events timed, usage read.

The benchmark client shares the machine's cores with the cluster it measures, so it does as
little as it can per event: no JSON per token event (only the final usage event is parsed),
de-chunking by hand on a keep-alive connection. Not for production use.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class BenchHTTPError(RuntimeError):
    pass


@dataclass(slots=True)
class StreamTiming:
    sent: float  # perf_counter when the request was written
    first_token: float  # perf_counter of the first event with a choice (the first token's)
    done: float
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent


class SSEConnection:
    """One keep-alive connection; `post_stream` may be called again once a stream ended."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = self.reader = None

    async def post_stream(self, path: str, body: dict[str, object]) -> StreamTiming:
        if self.writer is None:
            await self._connect()
        assert self.reader is not None and self.writer is not None
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        sent = time.perf_counter()
        self.writer.write(head + payload)
        status_line = await self.reader.readline()
        headers: dict[str, str] = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1]) if status_line else 0
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            text = await self._body(headers, chunked)
            await self.close()
            raise BenchHTTPError(f"HTTP {status}: {text[:300]!r}")
        first = 0.0
        usage = 0
        buf = b""
        while True:
            data = await self._next_piece(chunked, headers)
            if data is None:
                break
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: [DONE]"):
                    if not chunked:
                        await self.close()
                    else:
                        await self._drain_chunks()
                    return StreamTiming(sent, first or time.perf_counter(), time.perf_counter(), usage)
                if not first and b'"choices":[{' in event.replace(b" ", b""):  # the first token's event
                    first = time.perf_counter()
                if b'"usage"' in event:
                    m = _USAGE.search(event)
                    if m:
                        usage = int(m.group(1))
        await self.close()
        raise BenchHTTPError("stream ended without data: [DONE]")

    async def _next_piece(self, chunked: bool, headers: dict[str, str]) -> bytes | None:
        assert self.reader is not None
        if not chunked:
            data = await self.reader.read(65536)
            return data or None
        size_line = await self.reader.readline()
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await self.reader.readline()
            return None
        data = await self.reader.readexactly(size + 2)
        return data[:-2]

    async def _drain_chunks(self) -> None:
        """Read up to the terminating zero-size chunk so the connection can be reused."""
        while await self._next_piece(True, {}) is not None:
            pass

    async def _body(self, headers: dict[str, str], chunked: bool) -> bytes:
        assert self.reader is not None
        if chunked:
            out = b""
            while (piece := await self._next_piece(True, headers)) is not None:
                out += piece
            return out
        return await self.reader.readexactly(int(headers.get("content-length", "0")))
