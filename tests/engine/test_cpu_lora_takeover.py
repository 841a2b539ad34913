"""The device takes a CPU-assisted prefill over inside the step (issue 31): when the adapter's load lands
between layers, the remaining layers of the same step run its rows on the device path, and a prompt
longer than a CPU chunk is not cut when its load should land within its assisted step — one step to
the first token, not ceil(n / chunk). Tokens equal PEFT's and the warm run's; real helpers, real loads
(held by the test until a given layer, so no timing decides where the takeover happens)."""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.gpu_worker.cold_metrics import cold_starts
from services.gpu_worker.engine.checkpoint_gen import make_lora
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from shared.policy.lora_cold_choice import LinearFit, LinkRates
from lora_fixtures import GREEDY, base_assets, finish, hold_loads, prompt

assets = base_assets("cold-takeover")
LAND_AT = 1  # the test opens the load during layer 1's helper call: the device takes over at layer 2


@pytest.fixture(scope="module")
def engine(assets):
    base, _ = assets
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_num_batched_tokens=256, cpu_lora_assist=True,
                                 cpu_lora_processes=1, lora_load_bandwidth=1e9, cpu_lora_chunk=16))
    eng.cold.start_helpers(wait=True)
    calls: list[tuple[int, str]] = []  # (layer, adapters) of every helper call
    helpers = eng.runner.cpu_lora
    submit = helpers.submit

    def spy(layer, group, x, segments):
        calls.append((layer, ",".join(s.adapter for s in segments)))
        return submit(layer, group, x, segments)

    helpers.submit = spy
    eng.helper_calls = calls
    steps: list[list[tuple[int, bool]]] = []
    execute = eng.runner.execute

    def seen(out, hidden=None):
        steps.append([(len(c.token_ids), c.lora_on_cpu) for c in out.chunks])
        return execute(out, hidden)

    eng.runner.execute = seen
    eng.steps = steps
    yield eng
    eng.cold.close()


def _assisted_step_costs(eng: LLMEngine, a: float) -> None:
    """The engine's T_cpu line as if an assisted step took `a` s plus 1 us per cold row x rank."""
    fit = LinearFit()
    for x in (100, 200):
        fit.add(x, a + 1e-6 * x)
    eng.cold.costs.cpu = fit


def _land_during(eng: LLMEngine, name: str, layer: int) -> None:
    """Open `name`'s held load inside the helper call of `layer` and wait there until it has landed."""
    gate = hold_loads(eng)
    helpers = eng.runner.cpu_lora
    submit = helpers.submit

    def opening(lay, group, x, segments):
        ticket = submit(lay, group, x, segments)
        if lay == layer and not gate.is_set():
            gate.set()
            for _ in range(6000):
                if eng.cold.loads.landed(name):
                    break
                eng.cold.loads.wait(0.01)
            assert eng.cold.loads.landed(name), "the held load did not land"
        return ticket

    helpers.submit = opening


def test_the_device_takes_over_between_layers_and_the_prompt_needs_one_step(engine, assets):
    base, root = assets
    path = make_lora(root / "t", base, rank=8, targets=["q", "v"], seed=4)
    engine.add_lora("t", path)
    _assisted_step_costs(engine, 10.0)  # a whole-prompt assisted step ~10 s: the ~us load lands within it
    _land_during(engine, "t", LAND_AT)
    engine.steps.clear()
    engine.helper_calls.clear()
    ids = prompt(60, 5)  # over the 16-token CPU chunk
    engine.add_request("r", ids, GREEDY, adapter="t")
    first = [t for d in engine.step() for t in d.new_token_ids]
    assert len(first) == 1  # one step: the whole prompt, its first token
    assert engine.steps[0] == [(60, True)] and engine.cold.uncut == 1
    assert sorted({layer for layer, _ in engine.helper_calls}) == list(range(LAND_AT + 1))  # layers 0, 1 only
    assert engine.cold.mid_step_takeovers == 1 and engine.cold.device_takeovers == 1
    out = first + finish(engine)["r"]
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:].argmax(-1).tolist()
    assert out == want  # PEFT's greedy tokens
    engine.add_request("warm", ids, GREEDY, adapter="t")  # resident now: the all-device run
    assert finish(engine)["warm"] == out
    # the step's T_cpu measurement counts the cold rows for the share of layers they ran on the helpers
    assert engine.cold.costs.cpu.n == 3
    # what the worker publishes (InstanceStats.lora_cold): the choice per cold request, the takeover
    stats = cold_starts(engine)
    assert stats.cpu_assist == 1 and stats.mid_step_takeovers == 1
    assert [(d.request_id, d.choice) for d in stats.recent] == [("r", "cpu_assist")]


def test_a_chunk_is_cut_when_its_load_should_land_after_the_assisted_step(engine, assets):
    base, root = assets
    engine.add_lora("c", make_lora(root / "c", base, rank=8, targets=["q", "v"], seed=6))
    _assisted_step_costs(engine, 1e-3)
    engine.cold.costs.links = LinkRates({"pageable": 1.0})  # X: the adapter's bytes at 1 B/s
    gate = hold_loads(engine)
    engine.steps.clear()
    ids = prompt(60, 7)
    engine.add_request("r2", ids, GREEDY, adapter="c")
    assert engine.step() == []  # cut: 16 tokens on the helpers, no token yet
    assert engine.steps[0] == [(16, True)] and engine.cold.uncut == 1  # (the previous test's)
    gate.set()
    cold = finish(engine)["r2"]
    engine.add_request("w2", ids, GREEDY, adapter="c")
    assert finish(engine)["w2"] == cold
