"""A worker whose model cannot be loaded says which and why, and exits 1 (never serves half)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from service_procs import ServiceProcess

CONFIG = """
[[models]]
name = "ghost"
path = "{path}"

[[workers]]
id = "w0"
memory = "64MiB"
models = ["ghost"]
"""


async def test_a_missing_checkpoint_fails_the_start_with_its_path(tmp_path: Path, nats_url: str) -> None:
    missing = tmp_path / "no-such-model"
    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG.format(path=missing))
    worker = ServiceProcess("gpu_worker", nats_url, config, "worker-ghost", "--worker-id", "w0").start()
    try:
        code = await asyncio.to_thread(worker.proc.wait, 60)  # type: ignore[union-attr]
        log = worker.log()
        assert code == 1, log[-2000:]
        assert "model 'ghost': no checkpoint at" in log and str(missing) in log
    finally:
        worker.stop()
