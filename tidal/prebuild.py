"""`tidal up`'s kernel step: build gpu_ext's CPU attention kernel before any CPU worker starts.

The compile takes a minute on a busy 2-core box; inside a worker it would run while `tidal up`
waits for that worker's health. `make install` builds it already; this catches the rest (a plain
`pip install`, a new CPU or torch). It runs as its own process, so the launcher never imports torch,
and only when the kernel is missing (`cpu_attention.pending()` reads no more than a file's presence).
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Callable

from shared.config import ClusterConfig


def wanted(cfg: ClusterConfig, services: list[str] | None, workers: list[str] | None) -> bool:
    """Whether this `tidal up` starts a CPU worker that serves a model and the kernel is not built yet."""
    from gpu_ext import cpu_attention

    if services is not None and "gpu_worker" not in services:
        return False
    starting = [w for w in cfg.workers if workers is None or w.id in workers]
    return any(w.device == "cpu" and w.models for w in starting) and cpu_attention.pending()


async def build_kernels(cfg: ClusterConfig, services: list[str] | None, workers: list[str] | None,
                        stop: asyncio.Event, out: Callable[[str], None]) -> bool:
    """Build it if wanted, printing what the build says. False only when `stop` is set meanwhile
    (the build is killed); a failed build leaves the workers on the torch path and returns True."""
    if not wanted(cfg, services, workers):
        return True
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpu_ext.cpu_attention", "--build", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []

    async def relay() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            if line.startswith("tidal:"):
                out(line)
        await proc.wait()

    relayed = asyncio.ensure_future(relay())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({relayed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not relayed.done():  # Ctrl-C during the build
        proc.kill()
        await asyncio.gather(relayed, return_exceptions=True)
        return False
    said = [line for line in lines if line.strip() and not line.startswith("tidal:")]
    if proc.returncode != 0:  # the build command itself broke (not a compile error: that exits 0)
        out(f"tidal: the kernel build exited with {proc.returncode}; workers use the torch path:\n"
            + "\n".join(f"    {line}" for line in said[-8:]))
    elif any("did not build" in line for line in lines):  # why, from the compiler / torch
        out("\n".join(f"    {line[:400]}" for line in said[-8:]))
    else:
        out(f"tidal: kernel step done in {time.monotonic() - started:.0f}s")
    return True


__all__ = ["build_kernels", "wanted"]
