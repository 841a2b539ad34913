"""The memory market (pure): every source of device memory priced in one unit, bought cheapest first.

The unit is the **request-second**: the seconds of delay a purchase is expected to add, summed over
the requests it delays, within the horizon (a request that misses its TTFT SLO by x seconds counts x;
one slowed by a pipeline for d seconds at overhead f counts f x d). One unit lets the arbiter compare
an eviction, a layer drop, a migration, a start and waiting; GPU-seconds would not (every source
here uses a GPU the cluster already has).

A `Need` is bytes a scope (one worker's KV, or a model with nowhere to put its requests) must find
within `horizon_s`, and the requests that wait until it does. An `Offer` is one purchasable block of
memory: its source, what it acts on, the bytes it frees, its price, and an opaque payload (what the
caller executes: the planner's decisions, the simulator's action). `buy` takes offers by price per
byte, cheapest first, while each is cheaper per byte than waiting (the reserve price: `queue_price`),
until the need is covered; the rest of the need waits. Prices come from `price_*` below, whose inputs
come from the one movement cost model (shared/policy/movement.py), the pipeline profile
(shared/policy/kunserve_profile.py) and the forecasts (shared/policy/forecast_outlook.py): no
constant of its own.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

# "prefix": cached-free prefix blocks (priced in shared/policy/prefix_price.py); first, so that on a tie in
# price per byte the cache is given up before anything else
Source = Literal["prefix", "prewarm", "adapter", "layers", "migrate", "scale_out", "queue"]
SOURCES: tuple[Source, ...] = ("prefix", "prewarm", "adapter", "layers", "migrate", "scale_out", "queue")
UNIT = "request_s"
# The chance a model needs a new instance when no forecast says (a predictor down, a model it never saw),
# live and simulated alike: 1, a replica nobody can price is priced as needed. Its loss is asymmetric: an
# eviction wrongly priced free costs a cold start to every arrival meanwhile and cannot be undone within the
# horizon, while a replica wrongly kept costs only what the market then buys instead (priced). Priced 0, the
# market would sell every unforecast replica first, so a predictor outage would strip the prewarms.
NO_FORECAST_CHANCE = 1.0


@dataclass(frozen=True)
class Need:
    scope: str  # "worker:<id>" (its KV) or "model:<name>" (no instance has room)
    bytes: int  # memory to find
    horizon_s: float  # within this long (the planning horizon)
    waiting: int  # requests that wait until it is found (>= 1 for a need worth pricing)
    drain_bytes_per_s: float  # how fast the scope frees memory by itself (finishing requests)
    # running requests the engine would preempt if nothing is bought (their KV growth does not fit), and
    # what recomputing one costs (re-prefilling its context): waiting is dearer when it means preempting
    preempted: int = 0
    recompute_s: float = 0.0
    # the least a purchase must free to help at all: the first waiting prompt (with the growth that must fit
    # beside it), an instance's weights; a purchase short of it buys nothing (0: every byte helps, KV growth)
    min_bytes: int = 0
    # each waiting request's time left to its TTFT SLO (<= 0: already past it), for the first len(slack_s) of
    # `waiting`; a wait counts only beyond a request's slack (the unit: delay past the SLO, what moves the tail),
    # in full for one already past it; () : every wait counts in full (no SLO known: the live planner)
    slack_s: tuple[float, ...] = ()
    # how long the need lasts: an offer's bytes count for the part of it they are free (bytes x duration);
    # 0: the horizon
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.bytes < 0 or self.horizon_s <= 0 or self.waiting < 0 or self.drain_bytes_per_s < 0
                or self.preempted < 0 or self.recompute_s < 0 or not 0 <= self.min_bytes <= self.bytes
                or len(self.slack_s) > self.waiting or not math.isfinite(self.duration_s) or self.duration_s < 0
                or not all(math.isfinite(x) for x in self.slack_s)):
            raise ValueError(f"need {self.scope}: bytes, waiting, drain, preempted, recompute_s and duration_s must be "
                             f">= 0, horizon_s > 0, min_bytes in [0, bytes], finite slacks at most one per waiting "
                             f"request (got {self.bytes}, {self.waiting}, {self.drain_bytes_per_s}, {self.preempted}, "
                             f"{self.recompute_s}, {self.duration_s}, {self.horizon_s}, {self.min_bytes}, "
                             f"{len(self.slack_s)} slacks)")

    @property
    def lasts_s(self) -> float:
        """How long the need lasts (the horizon unless the caller knows more)."""
        return self.duration_s or self.horizon_s

    def wait_cost(self, wait_s: float) -> float:
        """Request-seconds its waiting requests lose if each waits `wait_s` more (`wait_cost`)."""
        return wait_cost(wait_s, self.waiting, self.slack_s)


@dataclass(frozen=True)
class Offer:
    source: Source
    target: str  # what it acts on: "w1/m" (a prewarm), "w1/adapter-3", "w1+w2" (a group), a request id, ...
    bytes: int  # memory it makes available to the need
    price: float  # request-seconds
    payload: object = field(default=None, compare=False)  # what the caller executes when it is bought
    # True: any part of it can be bought at its price per byte (cached prefix blocks: evict n of them);
    # False: it is bought whole, and pays its whole price for the part a need uses (an adapter, a group)
    divisible: bool = False
    # bytes x duration: its bytes are free only from `after_s` (a start once it lands, a migration once its copy
    # hands over) and for `lasts_s` (an offload until the adapter's next use; inf: for good, or until a
    # restore the price already charges)
    after_s: float = 0.0
    lasts_s: float = math.inf

    def __post_init__(self) -> None:
        if (self.bytes < 0 or not math.isfinite(self.price) or self.price < 0 or not math.isfinite(self.after_s)
                or self.after_s < 0 or not self.lasts_s > 0):
            raise ValueError(f"offer {self.source} {self.target}: bytes must be >= 0, price finite >= 0, after_s "
                             f"finite >= 0 and lasts_s > 0 (got {self.bytes}, {self.price}, {self.after_s}, "
                             f"{self.lasts_s})")

    def cover(self, duration_s: float) -> float:
        """The share of a need lasting `duration_s` during which its bytes are free, in [0, 1]."""
        if duration_s <= 0:
            raise ValueError(f"offer {self.target}: a need's duration must be > 0, got {duration_s}")
        start = min(duration_s, self.after_s)
        return max(0.0, min(duration_s, self.after_s + self.lasts_s) - start) / duration_s

    def useful_bytes(self, duration_s: float) -> int:
        """Its bytes weighted by the share of the need they serve (bytes x duration / the need's duration)."""
        return int(self.bytes * self.cover(duration_s))

    @property
    def unit_price(self) -> float:
        """Request-seconds per byte (inf for an offer that frees nothing)."""
        return self.price / self.bytes if self.bytes else math.inf


@dataclass(frozen=True)
class Purchase:
    need: Need
    offers: tuple[Offer, ...]  # every offer priced, cheapest per byte first (the price list)
    bought: tuple[Offer, ...]  # those taken, in order
    reserve_unit_price: float  # waiting's price per byte: nothing dearer is bought

    @property
    def bought_bytes(self) -> int:
        return sum(o.bytes for o in self.bought)

    @property
    def covered(self) -> bool:
        return self.bought_bytes >= self.need.bytes

    @property
    def price(self) -> float:
        """What was bought, plus waiting for the part not covered."""
        short = max(0, self.need.bytes - self.bought_bytes)
        return sum(o.price for o in self.bought) + short * self.reserve_unit_price


# --- the prices (request-seconds) ------------------------------------------------------------
def wait_cost(wait_s: float, waiting: int, slack_s: Sequence[float] = ()) -> float:
    """Request-seconds `waiting` requests lose if each waits `wait_s` more: the part of the wait beyond a
    request's slack to its TTFT SLO (the unit: a request that misses its SLO by x counts x, one within it 0,
    so the objective reads the tail, not the mean delay); a request already past its SLO (slack <= 0) counts
    every second; those without a slack given (the rest of `waiting`) count in full."""
    if wait_s < 0 or waiting < len(slack_s):
        raise ValueError(f"wait cost: wait_s >= 0 and at most one slack per waiting request "
                         f"(got {wait_s}, {waiting}, {len(slack_s)})")
    return sum(max(0.0, wait_s - max(0.0, s)) for s in slack_s) + (waiting - len(slack_s)) * wait_s


def queue_price(need: Need, later: float = 0.0) -> float:
    """Waiting (queue or preempt): each waiting request waits until the scope frees the bytes itself;
    each request the engine preempts for want of the bytes waits as long and then recomputes its context
    (vLLM's recompute preemption). A wait is counted in full, as a start's is, with one horizon rule for
    both: at the horizon's end the need is re-planned, so waiting costs at most the horizon's waiting
    plus `later`, what the purchase then costs (`buy` passes the cheapest cover on the market now; 0
    when nothing is on it: a scope that frees nothing waits the horizon and is priced again)."""
    if need.bytes == 0:
        return 0.0
    if later < 0:
        raise ValueError(f"need {need.scope}: later must be >= 0 (got {later})")

    def cost(wait: float) -> float:
        return need.wait_cost(wait) + need.preempted * (wait + need.recompute_s)

    drained = cost(need.bytes / need.drain_bytes_per_s) if need.drain_bytes_per_s > 0 else math.inf
    return min(drained, cost(need.horizon_s) + later)


def price_eviction(chance_needed: float, arrival_rps: float, cold_start_s: float, warm_start_s: float) -> float:
    """The one eviction price: taking memory a model holds for later (a prewarmed replica, or a whole idle-ish
    instance scaled down) means that, with the forecast's chance that the model needs the instance before it
    could be put back, its next start takes `cold_start_s` instead of `warm_start_s` (a prewarm hit for a
    replica; 0 for a live instance, which needed no start at all); the requests arriving meanwhile (and the
    first) wait the extra time, half of it on average."""
    _prob(chance_needed)
    if arrival_rps < 0 or cold_start_s < 0 or warm_start_s < 0:
        raise ValueError("eviction: arrivals and start times must be >= 0")
    extra = max(0.0, cold_start_s - warm_start_s)
    return chance_needed * extra * (1.0 + arrival_rps * extra / 2.0)


def price_prewarm_eviction(chance_needed: float, arrival_rps: float, cold_start_s: float, hit_start_s: float) -> float:
    """Evicting a prewarmed replica: `price_eviction` with the hit it would have given."""
    return price_eviction(chance_needed, arrival_rps, cold_start_s, hit_start_s)


def price_capacity_eviction(chance_needed: float, arrival_rps: float, cold_start_s: float, gone_s: float,
                            horizon_s: float) -> float:
    """Scaling down a live instance of an under-loaded model to give its GPUs to another's need: `price_eviction`
    over the whole time the model is one instance fewer, not only its restart. The instance takes no new request
    from the moment it is taken (it drains, then the start lands, then it serves the need), for `gone_s` (the
    span the need holds its GPUs: the need's expected duration), and is back only a cold start after that (the
    start evicts its weights). With the forecast's chance the model needs that instance meanwhile
    (`chance_needed`, one instance fewer), the arrivals it would have served (`arrival_rps`: its model's arrivals
    over its accepting instances, the dispatcher's spread) queue until it is back; otherwise they go elsewhere at
    no cost. Charged over the restart alone (issue 32: the price before), taking an instance for a 300 s need cost
    the same as for a 10 s one. Waiting and starts on one horizon rule: the displaced arrivals wait at most the
    horizon (`horizon_s`) before their own need buys an instance back (a start), so the span charged is
    min(gone_s, horizon) + the cold start — charged over the whole need (300 s) the price of one 7B instance
    outweighed the 13B's whole burst and the burst collapsed (25 req/s seed 4: 21 s -> 78 s)."""
    if not (math.isfinite(gone_s) and gone_s >= 0):
        raise ValueError(f"capacity eviction: gone_s must be finite >= 0, got {gone_s}")
    if not horizon_s > 0:
        raise ValueError(f"capacity eviction: horizon_s must be > 0, got {horizon_s}")
    return price_eviction(chance_needed, arrival_rps, min(gone_s, horizon_s) + cold_start_s, 0.0)


def price_adapter_eviction(arrival_rps: float, horizon_s: float, cold_use_s: float, stalled: int = 1) -> float:
    """Evicting a resident adapter: the chance it is used within the horizon (Poisson arrivals) times
    its next cold use: `cold_use_s` extra for that request (CPU-assisted prefill) or, for an engine
    that loads inline, for every request of the batch it stalls (`stalled`)."""
    if arrival_rps < 0 or horizon_s < 0 or cold_use_s < 0 or stalled < 1:
        raise ValueError("adapter eviction: rates, horizon and cost must be >= 0 and stalled >= 1")
    return (1.0 - math.exp(-arrival_rps * horizon_s)) * cold_use_s * stalled


def drop_slowdown(efficiency: float) -> float:
    """How much slower each request of a pipelined group runs: a member serves its batch at step time /
    efficiency (the simulator's model of a group), so a step takes `1/efficiency - 1` longer; at the
    default profile's 0.828 that is 0.208 (not `1 - efficiency`, 0.172, which under-charges the drop)."""
    if not 0.0 < efficiency <= 1.0:
        raise ValueError(f"layer drop: efficiency must be in (0, 1], got {efficiency}")
    return 1.0 / efficiency - 1.0


def drop_duration_s(excess_bytes: float, net_drain_bytes_per_s: float, horizon_s: float, until_s: float) -> float:
    """How long a layer drop lasts: a group is restored only once its members' KV is back below the restore
    level, so it lasts until the KV above that level (`excess_bytes`) has drained at the scope's *net* drain
    (what finishing requests free less what running ones grow into), at least the horizon (the need's own
    duration) and at most `until_s` (the forecast window: the load may change then); a scope whose KV does not
    fall keeps it that long. Issue 32 item 2: bytes x expected duration."""
    if excess_bytes < 0 or horizon_s <= 0 or until_s < horizon_s:
        raise ValueError("drop duration: excess must be >= 0, the horizon > 0 and until_s >= the horizon")
    if excess_bytes == 0:
        return horizon_s
    if net_drain_bytes_per_s <= 0:
        return until_s
    return min(until_s, max(horizon_s, excess_bytes / net_drain_bytes_per_s))


def need_duration_s(excess_bytes: float, drain_bytes_per_s: float, inflow_bytes_per_s: float, horizon_s: float,
                    until_s: float) -> float:
    """How long a need lasts: until the scope has freed its bytes at its drain *net of what arrivals bring
    meanwhile* (`inflow_bytes_per_s`: the scope's share of its model's arrival rate x the KV each arrival comes to
    hold). While the arrivals' KV demand is at or above the drain the need persists: it lasts `until_s` (the
    forecast window: the load may change then); at least the horizon. Counting only the running requests' ends
    (no inflow) reads a need under a steady stream as over once those end, and a start that lands after that
    as covering none of it (issue 32: 106 of 133 start offers in the popularity shift had cover 0). The wait of
    the requests already waiting is another matter: they are ahead of the arrivals, so `queue_price` keeps the
    gross drain."""
    if drain_bytes_per_s < 0 or not (math.isfinite(inflow_bytes_per_s) and inflow_bytes_per_s >= 0):
        raise ValueError(f"need duration: drain and inflow must be finite >= 0 (got {drain_bytes_per_s}, "
                         f"{inflow_bytes_per_s})")
    return drop_duration_s(excess_bytes, drain_bytes_per_s - inflow_bytes_per_s, horizon_s, until_s)


def price_layer_drop(slowdown: float, running: int, duration_s: float, restore_s: float) -> float:
    """Dropping replicated layers into a buddy group: every running request of the members runs
    `slowdown` slower (`drop_slowdown`) for the expected duration of the need and the restore after it."""
    if not (math.isfinite(slowdown) and slowdown >= 0.0) or running < 0 or duration_s < 0 or restore_s < 0:
        raise ValueError(f"layer drop: slowdown finite >= 0, running, duration and restore >= 0 (got {slowdown})")
    return slowdown * running * (duration_s + restore_s)


def price_migration(stall_s: float, interference_s: float = 0.0) -> float:
    """Moving one request out: it runs nowhere for the pre-copy's last stage (a KV move) or the
    destination's re-prefill (a token move); `interference_s` is what the copy costs the destination's
    own requests (their added step time, summed)."""
    if stall_s < 0 or interference_s < 0:
        raise ValueError("migration: stall and interference must be >= 0")
    return stall_s + interference_s


def price_scale_out(start_s: float, waiting: int, eviction: float = 0.0, slack_s: Sequence[float] = ()) -> float:
    """A new instance: the waiting requests wait for its start (a prewarm hit, host memory or storage; on GPUs
    taken from an under-loaded model, that instance's drain first); a start that takes a GPU holding another
    model's prewarmed replica or live instance evicts it, and pays that eviction's own price (`eviction`:
    `price_eviction`, the evicted model's chance and arrivals included, so an eviction costs the same
    whichever source causes it). The wait is counted as waiting's is (`wait_cost`: past each request's SLO,
    `slack_s` the waiting requests' slacks), one rule for both."""
    if start_s < 0 or waiting < 0 or not (math.isfinite(eviction) and eviction >= 0):
        raise ValueError("scale out: start, waiting and the eviction's price must be >= 0")
    return wait_cost(start_s, waiting, slack_s) + eviction


def _prob(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a chance must be in [0, 1], got {p}")


# --- buying -------------------------------------------------------------------------------
def buy(need: Need, offers: Sequence[Offer]) -> Purchase:
    """Greedy by price per *useful* byte while that beats waiting for the same bytes, until the need is
    covered. Useful: an offer's bytes x the share of the need's duration they are free (`Offer.cover`: a start
    only once it lands, an offload until the adapter's next use), and at most what is still missing (an offer
    bigger than that pays its whole price for the part used, unless it is divisible: then only the part used
    is bought, at its price per byte). Waiting's price is `queue_price(need, later)`, `later` the same greedy
    cover bought with no reserve (what deferring the purchase to the re-plan costs on top of the horizon's
    wait). Ties go to the order of SOURCES, then the target (deterministic). A need with `min_bytes` is bought
    all or nothing: a purchase whose bytes fall short of it is not made (a 0.9 GiB offer does not admit a
    1 GiB prompt). A divisible offer cut to what was missing is in `bought` as a copy with those bytes and
    their price (the same payload); `offers` keeps it whole."""
    useful = {id(o): o.useful_bytes(need.lasts_s) for o in offers}
    ranked = tuple(sorted((o for o in offers if useful[id(o)] > 0),
                          key=lambda o: (o.price / useful[id(o)], SOURCES.index(o.source), o.target)))
    later = sum(o.price for o in _greedy(need, ranked, math.inf, useful))
    reserve = queue_price(need, later) / need.bytes if need.bytes else 0.0
    return Purchase(need, ranked, _greedy(need, ranked, reserve, useful), reserve)


def _greedy(need: Need, ranked: tuple[Offer, ...], reserve: float, useful: dict[int, int]) -> tuple[Offer, ...]:
    left, bought, missing = list(ranked), [], need.bytes

    def used_price(o: Offer) -> float:
        u = useful[id(o)]
        return o.price * min(u, missing) / u if o.divisible else o.price

    while missing > 0 and left:
        best = min(left, key=lambda o: (used_price(o) / min(useful[id(o)], missing), SOURCES.index(o.source),
                                        o.target))
        if used_price(best) >= reserve * min(useful[id(best)], missing):
            break  # waiting for these bytes is no dearer
        left.remove(best)
        got = useful[id(best)]
        if best.divisible and got > missing:
            share = missing / got
            best = replace(best, bytes=max(1, round(best.bytes * share)), price=best.price * share)
            got = missing
        bought.append(best)
        missing -= got
    if sum(o.bytes for o in bought) < need.min_bytes:
        return ()  # all or nothing: short of the indivisible part, nothing bought helps
    return tuple(bought)


__all__ = [
    "NO_FORECAST_CHANCE", "Need", "Offer", "Purchase", "SOURCES", "Source", "UNIT", "buy", "drop_duration_s", "drop_slowdown", "need_duration_s", "price_adapter_eviction", "price_layer_drop",
    "price_capacity_eviction", "price_eviction", "price_migration", "price_prewarm_eviction", "price_scale_out",
    "queue_price", "wait_cost",
]
