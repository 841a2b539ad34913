"""The load runner's keep-alive pool: an idle connection older than the server's keep-alive is not reused
(the server may close it just as a request is written: "closed before the status line")."""
from __future__ import annotations

import asyncio

from loadgen.runner.stream import ConnectionPool, StreamResult


async def test_an_idle_connection_past_max_idle_is_replaced() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        pool = ConnectionPool("127.0.0.1", port, max_idle_s=0.2)
        conn = pool.take()
        conn.reader, conn.writer = await asyncio.open_connection("127.0.0.1", port)
        pool.give_back(conn, StreamResult(sent=0.0, reusable=True))
        assert pool.take() is conn and pool.opened == 1  # fresh: reused
        pool.give_back(conn, StreamResult(sent=0.0, reusable=True))
        await asyncio.sleep(0.3)
        fresh = pool.take()
        assert fresh is not conn and pool.opened == 2 and conn.writer is None  # stale: closed, a new one
        pool.close()
    finally:
        server.close()
        await server.wait_closed()
