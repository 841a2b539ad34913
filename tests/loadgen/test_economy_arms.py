"""The economy's arms compare like with like (issue 32): every arm runs on the same non-memory base
(WarmServe's prewarm planner, CaraServe's CPU-assisted cold adapters), and the fixed order uses only
the sources its arm has."""
from __future__ import annotations

import dataclasses

import pytest

from loadgen.sim.economy import EconomySim
from loadgen.sim.economy_result import ARMS
from loadgen.sim.economy_state import ABLATIONS, ARM_CONFIGS, BASE
from loadgen.sim.request import SimRequest
from shared.policy.memory_market import Need

from test_economy_sim import _decoding, _hand_sim

# arm flag -> the offers it allows (the name of the source the offers are asked under)
FLAGS = {"prewarm_evict": "prewarm", "adapter_evict": "adapter", "layer_drop": "layers", "migrate": "migrate",
         "scale_out": "scale_out"}


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_has_the_same_non_memory_base(arm):
    cfg = ARM_CONFIGS[arm]
    assert cfg.prewarm == BASE["prewarm"] == "proactive" and cfg.cpu_assist is BASE["cpu_assist"] is True
    sim = _hand_sim(arm)
    assert sim.system.prewarm == "proactive"
    # a cold adapter never stalls the admitting step: its request's first token pays the CPU-assisted extra
    w = sim.instances["llama2-7b-0"][0].engine
    sim.ranks = {"lora-x": 64}
    req = SimRequest(1, "h", "llama2-7b-0", "lora-x", 0.0, 1000, 10)
    assert sim._cold_adapter(w, "lora-x", req) == 0.0
    assert sim.counts["cold_adapters_cpu"] == 1 and sim.counts["cold_adapters_inline"] == 0
    assert sim.ttft_extra[req.order] > 0


def _everything_triggers(sim: EconomySim) -> tuple[object, list[str]]:
    """Instance a of the hand sim in a state where every fixed-order trigger fires (a need, KV at 100%,
    requests blocked on memory), each source's offers recorded instead of built."""
    a, _ = sim.instances["llama2-7b-0"]
    _decoding(sim, a, 4)
    w = a.engine
    w.total = w.used
    w.waiting.append(SimRequest(99, "w", a.model, None, 0.0, 100, 10))
    w.blocked_on = "memory"
    asked: list[str] = []
    sim.arbiter.need = lambda inst, now: Need(f"worker:i{inst.id}", 2**30, 10.0, 1, 0.0)  # type: ignore[method-assign]
    for name in FLAGS.values():
        setattr(sim.pricer, f"{'layer' if name == 'layers' else name}_offers",
                lambda inst, now, name=name: asked.append(name) or [])
    return a, asked


def test_fixed_order_with_every_source_asks_every_source():
    sim = _hand_sim("fixed-order")
    a, asked = _everything_triggers(sim)
    sim.arbiter.fixed_order(a, 0.0)
    assert sorted(asked) == sorted(FLAGS.values())


@pytest.mark.parametrize("flag", list(FLAGS))
def test_fixed_order_never_uses_a_source_its_arm_has_off(flag, monkeypatch):
    name = f"fixed-no-{flag}"
    monkeypatch.setitem(ARM_CONFIGS, name, dataclasses.replace(ARM_CONFIGS["fixed-order"], name=name, **{flag: False}))
    sim = _hand_sim(name)
    a, asked = _everything_triggers(sim)
    for t in (0.0, 1.0, 2.0):
        sim.arbiter.fixed_order(a, t)
    assert FLAGS[flag] not in asked
    assert set(asked) == set(FLAGS.values()) - {FLAGS[flag]}


def test_the_autoscalers_starts_are_not_the_arms_purchases():
    from test_economy_sim import result

    for arm in ("warmserve", "arbiter"):
        sim, res = result(arm)
        assert res.counts["autoscaler_starts"] == sum(1 for s in sim.start_log if s.id not in sim.bought_starts)
        assert res.counts["autoscaler_starts"] > 0
        assert sum(1 for p in res.purchases if p.source == "scale_out") == len(sim.bought_starts)
    assert not any(p.source == "scale_out" for p in result("warmserve")[1].purchases)


@pytest.mark.parametrize("arm", sorted(ABLATIONS))
def test_an_ablation_never_asks_the_source_it_leaves_out_and_needs_fixed_order_ignores_prices(arm):
    cfg = ABLATIONS[arm]
    assert cfg.prewarm == BASE["prewarm"] and cfg.cpu_assist is True  # the same base as every arm
    sim = _hand_sim(arm)
    a, asked = _everything_triggers(sim)
    sim.executor.reclaim.offers = lambda inst, now, lasts_s: []  # type: ignore[method-assign]
    if arm == "needs-fixed-order":
        # the sources in SOURCES' order, whatever their prices: a dear adapter before a free migration
        from shared.policy.memory_market import Offer
        done: list[str] = []
        sim.arbiter.offers = lambda inst, now, need: [  # type: ignore[method-assign]
            Offer("migrate", "r", 2**30, 0.0, "m"), Offer("adapter", "x", 2**30, 99.0, "a")]
        sim.executor.execute = lambda o, now, unbought="": done.append(o.source) or True  # type: ignore[method-assign]
        sim.arbiter.needs_fixed_order(a, 0.0)
        assert done == ["adapter"]
        return
    left_out = arm.removeprefix("arbiter-no-")
    sim.arbiter.arbitrate(a, 0.0)
    assert left_out not in asked and set(asked) == set(FLAGS.values()) - {left_out}
