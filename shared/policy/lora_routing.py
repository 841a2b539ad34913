"""CaraServe's rank-aware routing (§5, Alg. 1) and the §7.5 baselines (MostIdle, FirstFit).

Pure: no I/O, no clock. Candidates serve the request's base model, have its adapter
registered and can host it on the device: resident already, or room to load it
(`InstanceView.adapter_room_bytes`: free pool bytes plus unpinned adapters it could evict;
None = unknown, assumed yes). Random is `shared.policy.routing.HashRandom` (seeded).

Rank-aware cost of sending request r to an instance whose running batch and queue hold
requests with ranks `exists` (Alg. 1, CalcCost):

    d_prefill = PrePerf(queue + r) - PrePerf(queue)
    d_decode  = DecPerf(exists + r) - DecPerf(exists)
    score     = d_prefill / avg_response_tokens + d_decode  (+ penalty if DecPerf(exists + r) > SLO)
    total     = score * len(exists) + own

`score * len(exists)` is the slowdown every request already there suffers (Alg. 1, line
8); `own` is r's own modeled time per token there (its prefill and, where the adapter is not
resident, its load spread over its response, plus a decode step of the new batch), so an idle
instance is not free, a fast one wins between idle ones, and a warm one wins unless the cold
one's batch is cheaper by more than the load. The least total wins; ties go to the smaller id.

`strict=True` (`rank-aware-strict` in the simulator) is Alg. 1 as published: total = score *
len(exists), no `own` term, so idle instances all cost 0 and tie (smaller id wins).

All four policies ask the admission gate for every instance that can host the adapter
(`adapter_gate = "hostable"`): the paper's baselines differ from Alg. 1 only in how they pick.
A load takes the adapter's bytes over the worker's load bandwidth (`load_bandwidth`, from
`[[workers]] lora_load_bandwidth`), else the profile's, else `cold_load_s` (the simulator's).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.policy.lora_perf_model import PAPER_PROFILE, Kernel, LoraPerfModel, LoraPerfProfile
from shared.policy.routing import AdapterGate, InstanceView, RequestView, can_host, candidates

DEFAULT_PENALTY_S = 1000.0  # added per affected request where the SLO would break: dwarfs any modeled time
DEFAULT_AVG_RESPONSE_TOKENS = 128.0


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """What the non-trivial policies need beyond a seed (from the config or the simulator)."""

    profile: LoraPerfProfile = PAPER_PROFILE
    kernel: Kernel = "segmented"
    tpot_slo_s: float | None = None  # absolute time-per-token SLO
    slo_factor: float | None = None  # or k x the unloaded decode step (one request, no adapter)
    avg_response_tokens: float = DEFAULT_AVG_RESPONSE_TOKENS
    penalty_s: float = DEFAULT_PENALTY_S
    load_bandwidth: Mapping[str, float] = field(default_factory=dict)  # worker id -> adapter load bytes/s
    default_load_bandwidth: float | None = None  # other workers' (the profile's); None: unknown
    cold_load_s: float = 0.0  # a load's time where bytes or bandwidth are unknown


def hostable(request: RequestView, instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Candidates (live, the model, the adapter registered, KV large enough) that can host the adapter."""
    return [inst for inst in candidates(request, instances) if can_host(request, inst)]


def _queue(inst: InstanceView) -> list[tuple[int, int]]:
    """(tokens, rank) per waiting request; the queued prompt tokens are split evenly (stats give the sum)."""
    ranks = inst.waiting_ranks
    if not ranks:
        return []
    each = max(1, inst.queued_prompt_tokens // len(ranks))
    return [(each, r) for r in ranks]


@dataclass(frozen=True, slots=True)
class Cost:
    score: float  # per request already there (Alg. 1 CalcCost), penalty included
    own: float  # the new request's own modeled time per token there
    affected: int  # requests already there (running + waiting)
    violates: bool  # DecPerf(exists + r) > SLO
    total: float


def calc_cost(model: LoraPerfModel, request: RequestView, inst: InstanceView, *, slo_s: float | None,
              avg_response_tokens: float = DEFAULT_AVG_RESPONSE_TOKENS,
              penalty_s: float = DEFAULT_PENALTY_S, load_s: float = 0.0, strict: bool = False) -> Cost:
    """Alg. 1's CalcCost; `load_s`: the adapter's load time there (0 when resident); `strict`: the
    published total (score x affected) without our `own` term."""
    rank = request.adapter_rank if request.adapter is not None else 0
    queue = _queue(inst)
    exists = [*inst.running_ranks, *inst.waiting_ranks]
    prefill_with = model.prefill_s([*queue, (request.prompt_tokens, rank)])
    decode_with = model.decode_s([*exists, rank])
    d_prefill = prefill_with - model.prefill_s(queue)
    d_decode = decode_with - model.decode_s(exists)
    violates = slo_s is not None and decode_with > slo_s
    score = d_prefill / avg_response_tokens + d_decode + (penalty_s if violates else 0.0)
    own = (prefill_with + load_s) / avg_response_tokens + decode_with
    affected = max(len(exists), inst.running_requests + inst.waiting_requests)
    total = score * affected if strict else score * affected + own
    return Cost(score=score, own=own, affected=affected, violates=violates, total=total)


class RankAware:
    name = "rank-aware"
    adapter_gate: AdapterGate = "hostable"

    def __init__(self, model: LoraPerfModel, *, tpot_slo_s: float | None = None, slo_factor: float | None = None,
                 avg_response_tokens: float = DEFAULT_AVG_RESPONSE_TOKENS, penalty_s: float = DEFAULT_PENALTY_S,
                 load_bandwidth: Mapping[str, float] | None = None, default_load_bandwidth: float | None = None,
                 cold_load_s: float = 0.0, strict: bool = False) -> None:
        if avg_response_tokens <= 0:
            raise ValueError(f"avg_response_tokens must be > 0, got {avg_response_tokens}")
        bandwidths = dict(load_bandwidth or {})
        bad = {w: b for w, b in bandwidths.items() if b <= 0}
        if bad or (default_load_bandwidth is not None and default_load_bandwidth <= 0) or cold_load_s < 0:
            raise ValueError(f"load bandwidths must be > 0 and cold_load_s >= 0, got {bad or default_load_bandwidth}, "
                             f"{cold_load_s}")
        self.load_bandwidth = bandwidths
        self.default_load_bandwidth = default_load_bandwidth
        self.cold_load_s = cold_load_s
        self.model = model
        if tpot_slo_s is None and slo_factor is not None:
            if model.decode_s([0]) <= 0:
                raise ValueError(f"the LoRA profile's unloaded decode step is {model.decode_s([0]) * 1e3:.3g} ms "
                                 "(a bad fit: profile again on a quiet host); cannot set an SLO relative to it")
            tpot_slo_s = slo_factor * model.decode_s([0])
        self.slo_s = tpot_slo_s
        self.avg_response_tokens = avg_response_tokens
        self.penalty_s = penalty_s
        self.strict = strict
        self.slo_penalties = 0  # candidates priced with the SLO penalty (DecPerf(exists + r) > SLO)
        if strict:
            self.name = "rank-aware-strict"

    @classmethod
    def from_options(cls, options: RoutingOptions, *, strict: bool = False) -> RankAware:
        return cls(options.profile.model(options.kernel), tpot_slo_s=options.tpot_slo_s,
                   slo_factor=options.slo_factor, avg_response_tokens=options.avg_response_tokens,
                   penalty_s=options.penalty_s, load_bandwidth=options.load_bandwidth,
                   default_load_bandwidth=options.default_load_bandwidth, cold_load_s=options.cold_load_s,
                   strict=strict)

    def load_s(self, request: RequestView, inst: InstanceView) -> float:
        """How long the adapter takes to load on `inst`: 0 when resident (or no adapter)."""
        if request.adapter is None or request.adapter in inst.resident_adapters:
            return 0.0
        bandwidth = self.load_bandwidth.get(inst.worker_id, self.default_load_bandwidth)
        if bandwidth and request.adapter_bytes > 0:
            return request.adapter_bytes / bandwidth
        return self.cold_load_s

    def cost(self, request: RequestView, inst: InstanceView) -> Cost:
        return calc_cost(self.model, request, inst, slo_s=self.slo_s, avg_response_tokens=self.avg_response_tokens,
                         penalty_s=self.penalty_s, load_s=self.load_s(request, inst), strict=self.strict)

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        best: tuple[float, str] | None = None
        for inst in hostable(request, instances):
            cost = self.cost(request, inst)
            self.slo_penalties += cost.violates
            key = (cost.total, inst.instance_id)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]


class MostIdle:
    """The least busy: fewest requests (running + waiting), then least outstanding work, then id."""

    name = "most-idle"
    adapter_gate: AdapterGate = "hostable"

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        pool = hostable(request, instances)
        if not pool:
            return None
        return min(pool, key=lambda i: (i.running_requests + i.waiting_requests, i.outstanding_tokens,
                                        i.instance_id)).instance_id


class FirstFit:
    """Punica's first fit: the first instance, in a stable order (instance id), whose batch has room.
    When none has (the simulator queues at the instance; the live dispatcher offers only instances
    with room), the one holding the fewest requests, so a request is never refused that could wait."""

    name = "first-fit"
    adapter_gate: AdapterGate = "hostable"

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        pool = sorted(hostable(request, instances), key=lambda i: i.instance_id)
        for inst in pool:
            if inst.running_requests + inst.waiting_requests < inst.max_batch:
                return inst.instance_id
        return min(pool, key=lambda i: (i.running_requests + i.waiting_requests, i.instance_id)).instance_id \
            if pool else None


__all__ = ["Cost", "FirstFit", "MostIdle", "RankAware", "RoutingOptions", "calc_cost", "can_host", "hostable"]
