"""A lean streaming HTTP/1.1 client for the load runner: one POST, every SSE event timed.

Thousands of these run in one asyncio process, so the per-event work is byte scanning only:
no JSON per token event (the response id and the final usage are pulled out with regexes),
de-chunking by hand on a keep-alive connection, one clock read per socket read (every event
in that read gets its time). Same approach as `tidal/bench/sse_client.py`, plus per-token
times, the response id, in-stream errors and HTTP errors returned instead of raised.

A token event is a `data:` event whose `choices` list is not empty: the gateway sends one
per TokenChunk, i.e. per engine step of that request (one token without speculation).
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_ID = re.compile(rb'"id":\s*"([^"]+)"')
_TOKEN_EVENT = b'"choices":[{'
_MESSAGE = re.compile(rb'"message":\s*"((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class StreamResult:
    sent: float  # perf_counter when the request's bytes were written
    status: int = 0  # HTTP status; 0 when no response came (connection error)
    token_times: list[float] = field(default_factory=list)  # perf_counter of each token event (a chunk of >= 1 tokens)
    completion_tokens: int | None = None  # from the usage event
    response_id: str | None = None
    done: float = 0.0  # when [DONE] (or the failure) was read
    error: str | None = None  # HTTP error body, in-stream error message or connection error
    reusable: bool = False  # the connection may carry another request

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class StreamTally:
    """What streams show while they run, for a live view: token events received by streams not yet
    finished, how many have had their first, and the last first-token latencies (from the send)."""

    __slots__ = ("events", "streaming", "first_token_s")

    def __init__(self) -> None:
        self.events = 0  # of unfinished streams (a finished one hands its exact count over, see `settle`)
        self.streaming = 0  # unfinished streams that have received a token
        self.first_token_s: list[float] = []

    def settle(self, conn: "StreamConnection") -> None:
        """`conn`'s stream ended (whatever way): its events no longer count as in flight."""
        self.events -= conn.events
        if conn.events:
            self.streaming -= 1
        conn.events = 0


class StreamConnection:
    """One keep-alive connection to the gateway; `post` again once a stream ended reusably."""

    __slots__ = ("host", "port", "reader", "writer", "tally", "events", "idle_since")

    def __init__(self, host: str, port: int, tally: StreamTally | None = None) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.tally = tally
        self.events = 0  # token events of the current stream
        self.idle_since = 0.0  # monotonic time it was given back to the pool

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None

    async def post(self, path: str, payload: bytes) -> StreamResult:
        """POST `payload` (JSON bytes), read the SSE stream to its end. Never raises on HTTP or
        stream errors (they come back in the result); cancellation closes the connection."""
        result = StreamResult(sent=time.perf_counter())
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                    f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
            result.sent = time.perf_counter()
            self.writer.write(head + payload)
            await self._read(result)
        except asyncio.CancelledError:
            self.close()
            raise
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            self.close()
            result.error = f"connection: {type(exc).__name__}: {exc}"
            result.done = time.perf_counter()
            return result
        if not result.reusable:
            self.close()
        return result

    async def _read(self, result: StreamResult) -> None:
        reader = self.reader
        assert reader is not None
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionResetError("closed before the status line")
        result.status = int(status_line.split()[1])
        chunked, length, closing = False, -1, False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                closing = b"close" in value.lower()
        if result.status != 200:
            body = await self._body(chunked, length)
            m = _MESSAGE.search(body)
            result.error = f"HTTP {result.status}: " + (m.group(1).decode(errors="replace") if m else
                                                        body[:300].decode(errors="replace"))
            result.done = time.perf_counter()
            result.reusable = not closing and (chunked or length >= 0)
            return
        buf = b""
        times = result.token_times
        while True:
            data = await self._piece(chunked)
            now = time.perf_counter()
            if data is None:
                result.error = result.error or "stream ended without data: [DONE]"
                result.done = now
                return
            buf += data
            start = 0
            while (end := buf.find(b"\n\n", start)) >= 0:
                event = buf[start:end]
                start = end + 2
                if _TOKEN_EVENT in event:
                    times.append(now)
                    if self.tally is not None:
                        self._count(now - result.sent)
                    if result.response_id is None:
                        m = _ID.search(event)
                        result.response_id = m.group(1).decode() if m else None
                elif event.startswith(b"data: [DONE]"):
                    result.done = now
                    if chunked:
                        while await self._piece(True) is not None:  # up to the zero-size chunk
                            pass
                    result.reusable = chunked and not closing
                    return
                elif b'"usage"' in event:
                    m = _USAGE.search(event)
                    result.completion_tokens = int(m.group(1)) if m else None
                elif event.startswith(b'data: {"error"'):
                    m = _MESSAGE.search(event)
                    result.error = "in-stream: " + (m.group(1).decode(errors="replace") if m else
                                                    event[:300].decode(errors="replace"))
            buf = buf[start:]

    def _count(self, since_sent: float) -> None:
        tally = self.tally
        assert tally is not None
        if not self.events:
            tally.streaming += 1
            tally.first_token_s.append(since_sent)
            del tally.first_token_s[:-200]
        self.events += 1
        tally.events += 1

    async def _piece(self, chunked: bool) -> bytes | None:
        reader = self.reader
        assert reader is not None
        if not chunked:
            data = await reader.read(65536)
            return data or None
        size_line = await reader.readline()
        if not size_line:
            return None
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return None
        data = await reader.readexactly(size + 2)
        return data[:-2]

    async def _body(self, chunked: bool, length: int) -> bytes:
        reader = self.reader
        assert reader is not None
        if chunked:
            parts = []
            while (piece := await self._piece(True)) is not None:
                parts.append(piece)
            return b"".join(parts)
        if length >= 0:
            return await reader.readexactly(length)
        return await reader.read(65536)


class ConnectionPool:
    """Idle keep-alive connections to one gateway; a request takes one or opens a new one."""

    def __init__(self, host: str, port: int, tally: StreamTally | None = None, max_idle_s: float = 20.0) -> None:
        self.host, self.port = host, port
        self.idle: list[StreamConnection] = []
        self.opened = 0
        self.tally = tally  # given to every connection it opens
        # below the gateway's keep-alive timeout (30 s): an older idle connection may be closed by the
        # server just as a request is written on it ("closed before the status line")
        self.max_idle_s = max_idle_s

    def take(self) -> StreamConnection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since > self.max_idle_s:
                conn.close()
                continue
            conn.tally = self.tally
            return conn
        self.opened += 1
        return StreamConnection(self.host, self.port, self.tally)

    def give_back(self, conn: StreamConnection, result: StreamResult) -> None:
        if result.reusable and conn.writer is not None:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


__all__ = ["ConnectionPool", "StreamConnection", "StreamResult", "StreamTally"]
