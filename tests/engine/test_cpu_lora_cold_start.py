"""Issue 20's cold start: helpers map the worker's one shared host copy from registration (no file read
on the request path), one helper call per layer for the groups the adapter targets, the device
taking over mid-prefill (CPU chunks), and OnDemand's inline load that stalls the batch."""
from __future__ import annotations

import shutil

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.gpu_worker.engine.checkpoint_gen import make_lora
from services.gpu_worker.engine.cpu_lora_wire import Kind, decode
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.lora_shared import SharedLayout, attach, share
from services.gpu_worker.engine.lora_adapter import load_adapter
from services.gpu_worker.engine.model_config import load_model_config
from lora_fixtures import GREEDY, base_assets, hold_loads, prompt

assets = base_assets("cold-start")


def test_shared_host_copy_round_trips_and_helpers_map_the_same_file(assets):
    base, root = assets
    cfg = load_model_config(str(base), None)
    path = make_lora(root / "rt", base, rank=8, targets=["q", "v"], seed=1)
    adapter = load_adapter(path, "rt", cfg, range(cfg.num_layers))
    moved, layout = share(adapter)
    again = attach(SharedLayout.decode(layout.encode()))
    assert set(again) == set(adapter.weights)
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(again[key][0], a) and torch.equal(again[key][1], b)
        assert torch.equal(moved.weights[key][0], a)
    moved.weights[(0, "q_proj")][0][0, 0] = 42.0  # one copy: a write through the engine's view is seen
    assert again[(0, "q_proj")][0][0, 0].item() == 42.0


def test_helpers_never_read_adapter_files_and_call_once_per_layer_for_qkv(assets):
    base, root = assets
    path = make_lora(root / "qkv", base, rank=16, targets=["q", "k", "v"], seed=3)
    copy = root / "qkv-copy"
    shutil.copytree(path, copy)
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_num_batched_tokens=256, cpu_lora_assist=True,
                                 cpu_lora_processes=2, lora_load_bandwidth=1e9, cpu_lora_chunk=0))
    try:
        eng.add_lora("c", copy)
        lora = eng.runner.lora
        assert set(lora.layouts) == {"c"}  # shared from registration: one file for the engine and every helper
        eng.cold.start_helpers(wait=True)
        shutil.rmtree(copy)  # the directory is gone: the helpers hold the shared copy
        sent: list[tuple[int, bytes]] = []
        eng.runner.cpu_lora.tap = lambda way, i, data: sent.append((i, data)) if way == "sent" else None
        gate = hold_loads(eng)
        ids = prompt(40, 2)
        eng.add_request("r", ids, GREEDY, adapter="c")
        first = []
        while not first:
            first = [t for d in eng.step() for t in d.new_token_ids]
        computes = [decode(d) for _, d in sent if decode(d).kind is Kind.COMPUTE]
        assert {c.group for c in computes} == {0}  # q|k|v only: no o / gate|up / down calls
        assert {c.layer for c in computes} == {0, 1, 2}
        assert len({(c.layer, c.group) for c in computes}) == 3  # one call per layer
        assert not [d for _, d in sent if decode(d).kind is Kind.REGISTER]  # none on the request path
        gate.set()
        ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path)
        with torch.no_grad():
            want = ref_model(torch.tensor([ids])).logits[0, -1].argmax().item()
        assert first == [want]
    finally:
        eng.cold.close()


def test_device_takes_over_mid_prefill(assets):
    base, root = assets
    path = make_lora(root / "mid", base, rank=8, targets=["q", "v"], seed=4)
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_num_batched_tokens=256, cpu_lora_assist=True,
                                 cpu_lora_processes=1, lora_load_bandwidth=1e9, cpu_lora_chunk=16))
    seen: list[tuple[int, bool]] = []
    execute = eng.runner.execute

    def spy(out, hidden=None):
        seen.extend((len(c.token_ids), c.lora_on_cpu) for c in out.chunks)
        return execute(out, hidden)

    eng.runner.execute = spy
    try:
        eng.add_lora("m", path)
        eng.cold.start_helpers(wait=True)
        gate = hold_loads(eng)
        ids = prompt(100, 5)  # one chunk of the whole prompt unless cut: no max_prefill_chunk
        eng.add_request("r", ids, GREEDY, adapter="m")
        assert eng.step() == []  # 16 tokens on the helpers, no token yet
        gate.set()
        while not eng.cold.loads.landed("m"):
            eng.cold.loads.wait(0.01)
        out: list[int] = []
        while eng.has_unfinished:
            out += [t for d in eng.step() for t in d.new_token_ids]
        assert seen[0] == (16, True) and seen[1] == (84, False)  # the rest of the prompt on the device
        assert eng.cold.device_takeovers == 1 and eng.cold.cpu_chunks == 1
        eng.add_request("w", ids, GREEDY, adapter="m")
        warm: list[int] = []
        while eng.has_unfinished:
            warm += [t for d in eng.step() for t in d.new_token_ids]
        assert out == warm
    finally:
        eng.cold.close()


def test_inline_load_stalls_the_step_for_its_paced_time(assets):
    base, root = assets
    path = make_lora(root / "inl", base, rank=32, targets=["q", "k", "v"], seed=6)
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, lora_load_bandwidth=1e6, lora_load_mode="inline",
                                 cpu_lora_assist=True))
    slept: list[float] = []
    eng.cold._sleep = slept.append  # noqa: SLF001
    eng.add_lora("i", path)
    eng.add_request("base", prompt(8, 1), GREEDY)
    eng.step()
    eng.add_request("r", prompt(8, 2), GREEDY, adapter="i")
    eng.step()  # loads "i" in the step: the base request's decode waited too
    nbytes = eng.runner.lora.resident["i"][0].nbytes
    assert eng.cold.loads is None and eng.runner.cpu_lora is None  # no loader thread, no helpers
    assert eng.cold.inline_loads == 1 and slept and slept[0] == pytest.approx(nbytes / 1e6, rel=0.2)
    while eng.has_unfinished:
        eng.step()
    assert eng.cold.inline_loads == 1


def test_bad_load_mode_is_refused(assets):
    base, _ = assets
    with pytest.raises(ValueError, match="load mode"):
        LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, lora_load_mode="lazy"))
