"""`[[workers]] min_step_time`: each engine step of an instance lasts at least the floor (a CPU
worker's tiny model steps in well under a millisecond), so a request's tokens come out one step
apart at no less than the floor (unpaced they come ~0.2 ms apart here)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.stream import Payload
from shared.config import parse_config
from shared.events import Assignment, SamplingParams

FLOOR_S = 0.02
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(Path(tmp_path_factory.mktemp("floor")) / "m", arch="llama", layers=2, hidden=64, heads=4,
                      kv_heads=2, seed=7)


def step_times(model: Path, min_step_s: float) -> list[float]:
    """When each step's payload reached `emit` (stream_interval 0: one payload per step), one request."""
    engine = LLMEngine(EngineConfig(str(model), pool_bytes=16 << 20, block_size=8, max_num_seqs=2,
                                    max_num_batched_tokens=64, device="cpu"))
    instance = ModelInstance("w0-tiny", "tiny", engine, "w0", min_step_s=min_step_s)
    times: list[float] = []
    done = threading.Event()

    def emit(payloads: list[Payload], ended: list[str], sent: threading.Event | None = None) -> None:
        times.extend(time.monotonic() for _ in payloads)
        if ended:
            done.set()
        if sent is not None:
            sent.set()

    instance.start(emit, lambda _iid, exc: done.set())
    try:
        instance.submit(Assignment(idempotency_key="r:0", request_id="r", instance_id="w0-tiny", model="tiny",
                                   prompt_token_ids=[1, 2, 3], arrival_ts=time.time(),
                                   sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)))
        assert done.wait(60), "the request did not end"
    finally:
        instance.stop()
    return times


def test_each_step_lasts_at_least_the_floor(model: Path) -> None:
    times = step_times(model, FLOOR_S)
    assert len(times) == TOKENS  # one payload a step, a token each
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= FLOOR_S * 0.95, gaps  # (monotonic clock granularity)


def test_the_config_key_reaches_the_worker_spec() -> None:
    text = ('[[models]]\nname = "m"\npath = "/m"\n[[workers]]\nid = "w0"\nmemory = "64MiB"\nmodels = ["m"]\n'
            'min_step_time = "10ms"\n')
    assert float(parse_config(text).workers[0].min_step_time) == pytest.approx(0.010)
    with pytest.raises(Exception, match="min_step_time"):
        parse_config(text.replace('"10ms"', '"-1s"'))
