"""Helpers for the gpu_worker tests: a tiny model + adapter, a config, a stream collector."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from service_procs import FAST_LIVENESS, registry_and_worker
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from shared.bus import Bus, Delivery, Subscription
from shared.events import Assignment, SamplingParams, StreamError, TokenChunk
from shared.subjects import request_out

MODEL = "tiny"
ADAPTER = "tiny-lora"
INSTANCE = "w0-tiny"

CONFIG = FAST_LIVENESS + """
[[models]]
name = "tiny"
path = "{model}"
max_context = 512

[[adapters]]
name = "tiny-lora"
base = "tiny"
path = "{adapter}"
rank = 4
targets = ["q_proj", "v_proj"]

[[workers]]
id = "w0"
device = "cpu"
memory = "64MiB"
models = ["tiny"]
adapters = ["tiny-lora"]
stream_interval = "20ms"
# the tiny model steps in ~0.2 ms: a 480-token request would end between two stats (or before a ctl lands)
min_step_time = "2ms"

[policies]
max_batch_size = 16
step_token_budget = 256
kv_block_tokens = 8
"""


def make_assets(directory: Path) -> Path:
    """Model, adapter and cluster.toml in `directory`; returns the config path."""
    model = make_model(directory / "tiny", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)
    adapter = make_lora(directory / "tiny-lora", model, rank=4, targets=["q", "v"], seed=9)
    path = directory / "cluster.toml"
    path.write_text(CONFIG.format(model=model, adapter=adapter))
    return path


@contextmanager
def one_worker(directory: Path) -> Iterator[str]:
    """A registry and one real worker `w0` on the harness's assets; yields the NATS url."""
    with registry_and_worker(directory, make_assets(directory)) as url:
        yield url


def assignment(request_id: str, prompt: list[int], *, attempt: int = 0, adapter: str | None = None,
               resume: list[int] | None = None, next_seq: int = 0, **sampling: object) -> Assignment:
    params = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **sampling}
    return Assignment(
        idempotency_key=f"{request_id}:{attempt}", request_id=request_id, instance_id=INSTANCE, model=MODEL,
        adapter=adapter, prompt_token_ids=prompt, sampling=SamplingParams(**params), arrival_ts=time.time(),  # type: ignore[arg-type]
        attempt=attempt, resume_token_ids=resume or [], next_seq=next_seq,
    )


@dataclass
class Stream:
    """Everything published on one request's out subject."""

    messages: list[TokenChunk | StreamError] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    sub: Subscription | None = None

    async def on_message(self, msg: TokenChunk | StreamError, _ctx: Delivery) -> None:
        self.messages.append(msg)
        if msg.final:
            self.done.set()

    async def wait(self, timeout: float = 30.0) -> "Stream":
        await asyncio.wait_for(self.done.wait(), timeout)
        await asyncio.sleep(0.1)  # anything published after the final chunk would show up now
        return self

    @property
    def chunks(self) -> list[TokenChunk]:
        return [m for m in self.messages if isinstance(m, TokenChunk)]

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def final(self) -> TokenChunk | StreamError:
        return self.messages[-1]


async def watch(bus: Bus, request_id: str) -> Stream:
    """Subscribe to the request's chunks (before assigning it, as the gateway does)."""
    stream = Stream()
    stream.sub = await bus.subscribe(request_out(request_id), TokenChunk | StreamError, stream.on_message)
    return stream
