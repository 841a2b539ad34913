"""Fixtures shared by the whole suite: a real nats-server on a free port."""
from __future__ import annotations

import os
import shutil

import pytest

# Triton picks its interpreter when it is first imported, and transformers and peft import it
# early: on a machine without an NVIDIA driver, set it before anything does, so that the suite
# runs gpu_ext's Triton kernels on CPU under the interpreter (tests/engine/test_triton_*.py).
if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None \
        and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

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
