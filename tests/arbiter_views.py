"""Hand-built views and stub mechanism policies for the memory arbiter's tests (tests/test_arbiter*.py).

The worked cluster: worker w1 serves model m, 95% of its KV in use (above the 0.9 watermark) with 4
requests waiting on 1000 prompt tokens; it holds model p's 2 GiB of weights prewarmed. w2 serves p.
Prices come from the `cpu` simulator cost profile and the default KunServe pipeline profile.
"""
from __future__ import annotations

from types import MappingProxyType

from shared.events.common import GroupMember, LayerRange
from shared.events.plan import FormGroup, Migrate
from shared.events.predict import Forecast, LoadQuantiles
from shared.events.registry import ModelRecord
from shared.planner.arbiter import ArbiterPolicy
from shared.planner.arbiter_offers import ArbiterSettings, Pricing
from shared.planner.effects import Decision
from shared.planner.view import AdapterView, ClusterView, InstanceView, RequestView, WorkerView
from shared.profiles import load_pipeline_profile

from services.planner.cost_profile import load_cost_profile

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
BLOCK = 64 * KIB  # one layer's KV for 16 tokens
LAYERS = 8  # per token: 64 KiB x 8 / 16 = 32 KiB
SETTINGS = ArbiterSettings(horizon_s=10.0, kv_high_watermark=0.9, kv_block_tokens=16, batch_size=4, request_time_s=2.0)
MODELS = {
    "m": ModelRecord(name="m", path="/m", num_layers=LAYERS, max_context=4096, weight_bytes=512 * MIB,
                     layer_bytes=64 * MIB),
    "p": ModelRecord(name="p", path="/p", num_layers=LAYERS, max_context=4096, weight_bytes=2 * GIB,
                     layer_bytes=256 * MIB),
}


def pricing(settings: ArbiterSettings = SETTINGS) -> Pricing:
    profile = load_cost_profile("cpu")
    return Pricing(profile.costs(), profile.step, load_pipeline_profile(), settings)


def forecast(model: str, p50: float, p90: float, rps: float = 2.0) -> Forecast:
    return Forecast(model=model, predictor_id="pred", issued_ts=0.0, window_start_ts=0.0, window_s=60.0,
                    avg_rps=rps, peak_rps=rps, concurrency_quantiles=LoadQuantiles(p50=p50, p90=p90))


def request(rid: str, kv_bytes: int) -> RequestView:
    tokens = kv_bytes // (BLOCK * LAYERS // 16)
    return RequestView(rid, prompt_tokens=tokens, tokens=tokens, kv_tokens=tokens, kv_bytes=kv_bytes,
                       projected_kv_bytes=kv_bytes)


def worker(wid: str, model: str, *, blocks: int = 1000, used: int = 0, waiting: int = 0, prompt_tokens: int = 0,
           requests: tuple[RequestView, ...] = (), running: int | None = None, prewarmed: dict[str, int] | None = None,
           adapters: tuple[AdapterView, ...] = (), alive: bool = True) -> WorkerView:
    """`blocks` x LAYERS of KV blocks (the pool's KV), `used` of them in use (the rest free KV, none free pool)."""
    capacity = blocks * LAYERS
    inst = InstanceView(instance_id=f"{wid}-{model}", model=model, worker_id=wid,
                        running=len(requests) if running is None else running, waiting=waiting,
                        queued_prompt_tokens=prompt_tokens, kv_blocks_total=capacity, kv_blocks_used=used * LAYERS,
                        kv_block_bytes=BLOCK, requests=requests, layers=(0, LAYERS))
    warm = dict(prewarmed or {})
    pool = {"weights": 512 * MIB, "prewarm": sum(warm.values()), "adapter": sum(a.bytes for a in adapters),
            "kv": capacity * BLOCK, "workspace": 0, "free": 0}
    return WorkerView(worker_id=wid, alive=alive, pool_capacity_bytes=sum(pool.values()),
                      pool_bytes=MappingProxyType(pool), instances=(inst,), prewarmed=MappingProxyType(warm),
                      adapters=adapters)


def cluster(now: float = 100.0, *, p_forecast: Forecast | None = None, w1: WorkerView | None = None,
            w2_alive: bool = True, adapter_rps: dict[str, float] | None = None) -> ClusterView:
    w1 = w1 or needy_w1()
    w2 = worker("w2", "p", used=100, requests=(request("q1", 4 * MIB),), alive=w2_alive)
    return ClusterView(now=now, workers={"w1": w1, "w2": w2}, models=MODELS,
                       forecasts={"p": p_forecast} if p_forecast else {}, adapter_rps=adapter_rps or {})


def needy_w1(**kw: object) -> WorkerView:
    args: dict = dict(used=950, waiting=16, prompt_tokens=1000, requests=(request("r1", 40 * MIB),), running=1,
                      prewarmed={"p": 2 * GIB})
    args.update(kw)
    return worker("w1", "m", **args)


UNLIKELY = forecast("p", 1.0, 2.0)  # p has 1 instance of batch 4: needing a second is a 4-sigma event
LIKELY = forecast("p", 10.0, 14.0)


class Stub:
    """A mechanism policy that proposes fixed decisions, and records what it hears back."""

    def __init__(self, name: str, decisions: list[Decision], follow: list[Decision] | None = None) -> None:
        self.name = name
        self.decisions = decisions
        self.follow = follow or []
        self.outcomes: list[tuple[str, str]] = []  # (effect kind, outcome type)
        self.declined: list[Decision] = []

    def decide(self, view: ClusterView, busy: object) -> list[Decision]:
        return list(self.decisions)

    def follow_ups(self, view: ClusterView, busy: object) -> list[Decision]:
        out, self.follow = self.follow, []
        return out

    def on_outcome(self, effect: object, outcome: object) -> None:
        self.outcomes.append((type(effect.actions[0]).__name__, type(outcome).__name__))  # type: ignore[attr-defined]

    def on_declined(self, decision: Decision, why: str) -> None:
        self.declined.append(decision)


def group_w1_w2() -> Decision:
    members = [GroupMember(worker_id="w1", instance_id="w1-m", layers=LayerRange(start=0, end=4)),
               GroupMember(worker_id="w2", instance_id="w2-m", layers=LayerRange(start=4, end=8))]
    return Decision(action=FormGroup(group_id="g1", model="m", members=members), trigger="kv_pressure")


def move_r1() -> Decision:
    return Decision(action=Migrate(request_id="r1", source="w1", destination="w2", destination_instance="w2-p"),
                    trigger="kv_pressure")


def arbiter(*policies: object, settings: ArbiterSettings = SETTINGS) -> ArbiterPolicy:
    return ArbiterPolicy(list(policies), pricing(settings), id_prefix="t-buy")  # type: ignore[arg-type]
