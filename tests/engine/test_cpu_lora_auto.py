"""The engine's per-request cold-start decision (`lora_load_mode="auto"`, issue 31): CPU assist while
T_cpu is unmeasured (that measures it), the asynchronous load when the measured T_cpu loses to X + P
and others run, an inline load when nothing else runs; each decision in the request's trace; tokens
equal to the warm run whichever path ran. Real helpers, real loads (paced: a CPU worker's link)."""
from __future__ import annotations

from pathlib import Path

from services.gpu_worker.engine.checkpoint_gen import make_lora
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams
from shared.policy.lora_cold_choice import LinearFit
from lora_fixtures import GREEDY, base_assets, finish, hold_loads, prompt

assets = base_assets("cold-auto")


def _engine(base: Path, bandwidth: float) -> LLMEngine:
    return LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_num_batched_tokens=256, cpu_lora_assist=True,
                                  cpu_lora_processes=1, lora_load_bandwidth=bandwidth, cpu_lora_chunk=16,
                                  lora_load_mode="auto"))


def _warm(eng: LLMEngine, rid: str, ids: list[int], adapter: str) -> list[int]:
    eng.runner.lora.ensure_resident([adapter])
    eng.add_request(rid, ids, GREEDY, adapter=adapter)
    return finish(eng)[rid]


def test_unmeasured_t_cpu_assists_and_measures_it(assets):
    base, root = assets
    eng = _engine(base, 1e9)
    try:
        eng.add_lora("a", make_lora(root / "a", base, rank=8, targets=["q", "v"], seed=4))
        eng.cold.start_helpers(wait=True)
        gate = hold_loads(eng)
        ids = prompt(60, 5)
        eng.add_request("r", ids, GREEDY, adapter="a")
        assert eng.cold.costs.cpu.n == 0
        eng.step()
        choice = eng.cold.costs.trace["r"]
        assert choice.kind == "cpu_assist" and "not measured" in choice.reason
        assert eng.cold.cpu_chunks == 1 and eng.cold.costs.cpu.n == 1  # the assisted step measured T_cpu
        assert eng.cold.costs.cpu_s(60, 8) > 0
        gate.set()
        cold = finish(eng)["r"]
        assert eng.cold.costs.prefill.n >= 1  # device steps measured P
        assert cold == _warm(eng, "w", ids, "a")
        assert eng.cold.costs.counts == {"cpu_assist": 1, "async": 0, "inline": 0}
    finally:
        eng.cold.close()


def _slow_helpers(eng: LLMEngine) -> None:
    """The engine's own T_cpu model as a helper 10 s per step would leave it (its P: 1 ms a step)."""
    cpu, pre = LinearFit(), LinearFit()
    for x in (100, 200):
        cpu.add(x, 10.0)
        pre.add(x, 0.001)
    eng.cold.costs.cpu, eng.cold.costs.prefill = cpu, pre


def test_slow_helpers_assist_alone_load_async_beside_others_and_inline_without_a_helper(assets):
    base, root = assets
    path = make_lora(root / "b", base, rank=8, targets=["q", "v"], seed=6)
    eng = _engine(base, 1e9)  # replaced below: the link is what makes X
    nbytes = 0
    try:
        eng.add_lora("probe", path)
        nbytes = eng.runner.lora.host["probe"].nbytes
    finally:
        eng.cold.close()
    eng = _engine(base, nbytes / 1.0)  # X = 1 s for this adapter, against helpers at 10 s a step
    try:
        for name in ("solo", "busy", "nohelp"):
            eng.add_lora(name, path)
        eng.cold.start_helpers(wait=True)
        ids = prompt(40, 9)
        # alone: the device takes the prompt over when the load lands (inside the step), so starting on
        # the helpers costs the request nothing: T_cpu = X + what P is left < X + P, and no one else waits
        _slow_helpers(eng)
        gate = hold_loads(eng)
        eng.add_request("r0", ids, GREEDY, adapter="solo")
        head = [t for d in eng.step() for t in d.new_token_ids]
        c = eng.cold.costs.trace["r0"]
        assert c.kind == "cpu_assist" and " < X 1000.0 ms" in c.reason and "O " not in c.reason
        gate.set()
        first = head + finish(eng).get("r0", [])
        # a base request decodes beside: assisting would slow its steps to the helpers' 10 s for X (O ~ 1 s),
        # T_cpu + O >= X + P; 1 s x 1 other > async's wait beyond X: the asynchronous load
        _slow_helpers(eng)
        gate = hold_loads(eng)
        eng.add_request("base", prompt(8, 1), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        eng.step()
        eng.add_request("r2", ids, GREEDY, adapter="busy")
        eng.step()
        c = eng.cold.costs.trace["r2"]
        assert c.kind == "async" and "+ O " in c.reason and ">=" in c.reason and eng.cold.loads.loading("busy")
        assert eng.cold.cpu_chunks == 1 and eng.cold.inline_loads == 0  # the base request was not stalled
        gate.set()
        second = finish(eng)["r2"]
        # its helpers failed (no helper for it) and nothing else runs: inline, in this very step
        eng.cold.no_assist.add("r3")
        eng.add_request("r3", ids, GREEDY, adapter="nohelp")
        head = [t for d in eng.step() for t in d.new_token_ids]  # loaded and prefilled in this step
        c = eng.cold.costs.trace["r3"]
        assert c.kind == "inline" and "no helper ready" in c.reason and "0 others" in c.reason
        assert "nohelp" in eng.runner.lora.resident and eng.cold.inline_loads == 1
        third = head + finish(eng)["r3"]
        assert first == second == third  # same weights, same prompt: whichever path, the same greedy tokens
        assert eng.cold.costs.counts == {"cpu_assist": 1, "async": 1, "inline": 1}
        # the landed copies were timed: they took the test's gate (ms), not the prior's 1 s, and X follows
        assert eng.cold.costs.links.rate("pageable") > 1.5 * nbytes
    finally:
        eng.cold.close()


def test_cpu_engine_never_page_locks(assets):
    base, root = assets
    eng = _engine(base, 1e9)
    try:
        eng.add_lora("c", make_lora(root / "c", base, rank=4, targets=["q"], seed=2))
        locks = eng.runner.lora.page_locks
        assert not locks.enabled and locks.kind("c") == "pageable"
        assert not any(a.is_pinned() for a, _ in eng.runner.lora.host["c"].weights.values())
    finally:
        eng.cold.close()


def test_paced_helpers_make_t_cpu_at_least_the_pace(assets):
    # cpu_lora_pace: each helper call lasts at least rows x rank x pace (a slower CPU's stand-in, the
    # bench's --cpu-ratio); the engine's T_cpu measurement sees it. 3 layers, q/v: one call a layer.
    base, root = assets
    pace = 2e-5  # 16 rows x rank 8 x 2e-5 = 2.6 ms a call, 7.7 ms a step
    eng = LLMEngine(EngineConfig(str(base), pool_bytes=64 << 20, max_num_batched_tokens=256, cpu_lora_assist=True,
                                 cpu_lora_processes=1, lora_load_bandwidth=1e9, cpu_lora_chunk=16,
                                 lora_load_mode="auto", cpu_lora_pace=pace))
    try:
        eng.add_lora("p", make_lora(root / "p", base, rank=8, targets=["q", "v"], seed=3))
        eng.cold.start_helpers(wait=True)
        gate = hold_loads(eng)
        eng.add_request("r", prompt(40, 2), GREEDY, adapter="p")
        eng.step()
        assert eng.cold.cpu_chunks == 1
        assert eng.cold.costs.cpu.predict(16 * 8) >= 3 * 16 * 8 * pace  # one measured step: the origin line
        gate.set()
        finish(eng)
    finally:
        eng.cold.close()
