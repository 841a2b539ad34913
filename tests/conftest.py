"""Fixtures shared by the whole suite: a real nats-server on a free port."""
from __future__ import annotations

import pytest

from shared.nats_server import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    """A fresh nats-server with JetStream, per test. Yields the NatsServer (url, restart())."""
    server = NatsServer(store_dir=tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url
