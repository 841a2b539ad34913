"""CaraServe's CPU-assisted cold start in the engine, with real helper processes and PEFT as the oracle.

The adapter's (paced) load is held at a gate the test opens, so which chunks ran on the CPU
helpers and where the device path took over is decided by the test, not by timing."""
from __future__ import annotations

import os
import pickle
import signal
import threading
from multiprocessing import reduction
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.cpu_lora_wire import HEADER_SIZE, Kind, decode
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("cpu-lora")
    base = make_model(root / "base", layers=2, hidden=64, heads=4, kv_heads=2, seed=5)
    adapters = {f"a{i}": make_lora(root / f"a{i}", base, rank=r, targets=ALL if i % 2 else ["q", "v"], seed=i)
                for i, r in enumerate([8, 16, 8, 32, 16, 8])}
    return base, adapters


class Gate:
    """Stands in for the pacing sleep: a load lands only once the test opens the gate."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def __call__(self, _seconds: float) -> None:
        self.open.wait(60)


@pytest.fixture(scope="module")
def engine(assets):
    torch.set_num_threads(1)
    base, adapters = assets
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_prefill_chunk=32, max_num_batched_tokens=256,
                                 cpu_lora_assist=True, cpu_lora_processes=2, lora_load_bandwidth=1e9))
    for name, path in adapters.items():
        eng.add_lora(name, path)
    eng.cold.start_helpers()
    eng.runner.cpu_lora.wait_ready()
    steps: list[list[tuple[str, bool, torch.Tensor | None]]] = []
    execute = eng.runner.execute

    def spy(out, hidden=None):  # records what each step ran where, and its logits
        result = execute(out, hidden)
        rows = dict(zip(result.sampled_seq_ids, result.logits if result.logits is not None else []))
        steps.append([(c.seq_id, c.lora_on_cpu, rows.get(c.seq_id)) for c in out.chunks])
        return result

    eng.runner.execute = spy
    eng.steps = steps
    yield eng
    eng.cold.close()


def _gate(engine) -> Gate:
    gate = Gate()
    engine.cold.loads._sleep = gate  # noqa: SLF001 - the pacing sleep is the test's gate
    return gate


def _run_until(engine, done) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        if done(tokens):
            return tokens
    raise AssertionError(f"engine did not get there: {tokens}")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _peft(base: Path, path: Path, ids: list[int]) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_cold_prefill_on_cpu_helpers_matches_peft(engine, assets):
    base, adapters = assets
    gate = _gate(engine)
    batch = {"r0": ("a0", _prompt(23, 1)), "r1": ("a1", _prompt(70, 2)), "rb": (None, _prompt(9, 3))}
    for rid, (adapter, ids) in batch.items():
        engine.add_request(rid, ids, GREEDY, adapter=adapter)
    first = _run_until(engine, lambda t: all(len(t.get(r, [])) >= 1 for r in batch))
    cpu = {(s, on) for step in engine.steps for s, on, _ in step}
    assert ("r0", True) in cpu and ("r1", True) in cpu and ("rb", True) not in cpu  # prefill ran on the helpers
    assert len(first["r0"]) == len(first["r1"]) == 1  # their decoding waited for the loads
    gate.open.set()
    rest = _run_until(engine, lambda t: not engine.has_unfinished)
    for rid, (adapter, ids) in batch.items():
        out = first[rid] + rest.get(rid, [])
        if adapter is None:
            continue
        ref = _peft(base, adapters[adapter], ids + out[:-1])
        assert ref[len(ids) - 1:].argmax(-1).tolist() == out, f"{rid}: greedy tokens differ from PEFT"
        first_logits = next(lg for step in engine.steps for s, on, lg in step if s == rid and on and lg is not None)
        assert (first_logits - ref[len(ids) - 1]).abs().max().item() <= 1e-4  # the CPU-computed first token
    assert engine.cold.fallbacks == 0


def test_device_path_takes_over_at_the_next_chunk_boundary(engine):
    gate = _gate(engine)
    ids = _prompt(100, 4)  # 4 chunks of 32
    engine.steps.clear()
    engine.add_request("t", ids, GREEDY, adapter="a3")
    engine.step()
    engine.step()
    gate.open.set()
    for _ in range(3000):  # landed between two steps
        if engine.cold.loads.landed("a3"):
            break
        engine.cold.loads.wait(0.01)
    cold = _run_until(engine, lambda t: not engine.has_unfinished)["t"]
    where = [on for step in engine.steps for s, on, _ in step if s == "t"]
    assert where[:2] == [True, True] and not any(where[2:])  # chunk 3 on: the device path
    engine.add_request("warm", ids, GREEDY, adapter="a3")  # resident now: the all-device ("Cached") run
    assert _run_until(engine, lambda t: not engine.has_unfinished)["warm"] == cold


def test_control_channel_carries_only_encoded_records(engine, monkeypatch):
    gate = _gate(engine)
    seen: list[tuple[str, bytes]] = []
    engine.runner.cpu_lora.tap = lambda way, _helper, data: seen.append((way, data))

    def no_pickle(*_a, **_k):
        raise AssertionError("pickled on the CPU LoRA path")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(reduction.ForkingPickler, "dumps", no_pickle)
    engine.add_request("p", _prompt(40, 5), GREEDY, adapter="a4")
    _run_until(engine, lambda t: len(t.get("p", [])) >= 1)
    monkeypatch.undo()
    engine.runner.cpu_lora.tap = None
    gate.open.set()
    _run_until(engine, lambda t: not engine.has_unfinished)
    kinds = [decode(data).kind for _, data in seen]
    assert Kind.COMPUTE in kinds and Kind.DONE in kinds
    assert all(len(data) == HEADER_SIZE for _, data in seen if decode(data).kind is not Kind.REGISTER)


def test_helper_death_mid_prefill_falls_back_to_waiting_for_the_load(engine):
    gate = _gate(engine)
    helpers = engine.runner.cpu_lora
    ids = _prompt(100, 6)
    engine.steps.clear()
    engine.add_request("d", ids, GREEDY, adapter="a5")
    engine.step()  # chunk 1 on the helpers
    killed: list[int] = []

    def kill_on_first_compute(way: str, index: int, data: bytes) -> None:
        if way == "sent" and not killed and decode(data).kind is Kind.COMPUTE:
            killed.append(helpers.pids()[index])
            os.kill(killed[0], signal.SIGKILL)  # dies with the call in flight
            helpers._helpers[index].proc.join(10)  # noqa: SLF001

    helpers.tap = kill_on_first_compute
    engine.step()  # chunk 2: the call fails mid-prefill, the request now waits for the load
    helpers.tap = None
    victim = killed[0]
    assert engine.cold.fallbacks == 1 and "d" in engine.cold.no_assist
    assert helpers.restarts >= 1 and victim not in helpers.pids()
    gate.open.set()
    tokens = _run_until(engine, lambda t: not engine.has_unfinished)["d"]
    where = [on for step in engine.steps for s, on, _ in step if s == "d"]
    assert where[0] is True and not any(where[1:])
    engine.add_request("d-warm", ids, GREEDY, adapter="a5")
    assert _run_until(engine, lambda t: not engine.has_unfinished)["d-warm"] == tokens  # never a wrong token
    helpers.wait_ready(120)  # the restarted helper serves again


def test_assist_off_waits_for_the_load_and_starts_no_helpers(assets):
    base, adapters = assets
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_prefill_chunk=32,
                                 cpu_lora_assist=False, lora_load_bandwidth=1e9))
    eng.add_lora("a0", adapters["a0"])
    gate = _gate(eng)
    eng.add_request("o", _prompt(23, 1), GREEDY, adapter="a0")
    for _ in range(5):
        assert eng.step() == []  # OnDemand: nothing runs until the adapter is on the device
    assert eng.runner.cpu_lora is None and eng.cold.cpu_chunks == 0
    gate.open.set()
    assert len(_run_until(eng, lambda t: not eng.has_unfinished)["o"]) == GREEDY.max_tokens
    eng.cold.close()
