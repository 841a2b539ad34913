"""The prefix economy simulator: cached prefixes on one worker's KV, released by price or by recency.

One worker's KV blocks (a cost profile's `[worker]`) are shared by two instances, `chat` and `rag`
(loadgen/sim/prefix_trace.py). A request's prefix, once prefilled, stays cached after the request ends
(cached-free: no request holds it) and a later request of the same instance with the same prefix
skips its prefill. Each instance prefills one request at a time, FCFS (the TTFT path: queueing plus
the prefill of its uncached tokens, the profile's `[step]`); decoding holds the request's blocks for
`output` steps at a fixed decode step. A request that finds too few free blocks has cached-free prefixes
released, by the arm:

- `off`: no caching (the prefix is the request's own KV, freed when it ends);
- `lru`: least recently used first, whatever it costs (vLLM's policy; our engine's within an instance);
- `instance`: the live arbiter's granularity: each instance's cached prefixes are one divisible offer
  priced by `prefix_price.price_prefix_eviction` with the instance's block hit rate over the window
  (what InstanceStats.prefix_hit_rate reports), least recently used first within the instance;
- `prefix`: one offer per cached prefix, priced with its own chance of reuse: of its look-ups in the
  window, the share that came after an earlier one (the hit rate an unbounded cache would have had:
  0 for a one-off document), an estimator only a per-prefix report would allow.

The priced arms buy with `memory_market.buy` against waiting (`queue_price`: the queued requests wait
until running ones free the blocks): the same market and price as the planner's arbiter.

    python -m loadgen.sim.prefix_economy [--minutes 10] [--seed 0] [--capacity 3000]
"""
from __future__ import annotations

import argparse
from collections import Counter, deque
from dataclasses import dataclass, field
from heapq import heappop, heappush

import numpy as np

from loadgen.sim.prefix_trace import PrefixRequest, PrefixTraceParams, prefix_trace
from loadgen.sim.profile import CostProfile, load_profile
from shared.policy.memory_market import Need, Offer, buy
from shared.policy.prefix_price import price_prefix_eviction, reuse_chance

ARMS = ("off", "lru", "instance", "prefix")
ARRIVE, PREFILLED, FINISH = 0, 1, 2


@dataclass(eq=False)
class Entry:
    instance: str
    prefix: str
    blocks: int
    tokens: int
    refs: int = 0
    last_used: float = 0.0


@dataclass
class PrefixResult:
    arm: str
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"chat": [], "rag": []})
    looked_up: Counter[str] = field(default_factory=Counter)  # prefix blocks looked up, by instance
    hit: Counter[str] = field(default_factory=Counter)  # ... and found cached
    released: Counter[str] = field(default_factory=Counter)  # cached prefixes released, by instance
    # releases that took a chat prompt while a rag document (a colder prefix) stayed cached-free
    chat_before_rag: int = 0

    def hit_rate(self, inst: str) -> float:
        return self.hit[inst] / self.looked_up[inst] if self.looked_up[inst] else 0.0

    def p(self, q: float, inst: str | None = None) -> float:
        xs = self.ttft[inst] if inst else self.ttft["chat"] + self.ttft["rag"]
        return float(np.percentile(xs, q)) if xs else float("nan")


class PrefixEconomySim:
    def __init__(self, trace: list[PrefixRequest], arm: str, profile: CostProfile, *, capacity_blocks: int,
                 window_s: float = 30.0, horizon_s: float = 10.0, decode_batch: int = 16) -> None:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        self.trace, self.arm, self.cost = trace, arm, profile.step
        self.bs, self.token_bytes = profile.worker.block_size, profile.worker.kv_bytes_per_token
        self.capacity, self.window_s, self.horizon_s = capacity_blocks, window_s, horizon_s
        self.tpot = self.cost.step_s(decode_batch, decode_batch * 1024)  # a decode step at a typical batch
        self.entries: dict[tuple[str, str], Entry] = {}
        self.live = 0  # blocks requests hold privately (suffix + output; the prefix too when not cached)
        self.queue: dict[str, deque[PrefixRequest]] = {"chat": deque(), "rag": deque()}
        self.busy = {"chat": False, "rag": False}
        self.lookups: deque[tuple[float, str, str, int, int]] = deque()  # (t, instance, prefix, blocks, hit)
        self.frees: deque[tuple[float, int]] = deque()  # (t, blocks) freed by finishing requests
        self.heap: list[tuple[float, int, int, object]] = []
        self.n = 0
        self.result = PrefixResult(arm)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    @property
    def free(self) -> int:
        return self.capacity - self.live - sum(e.blocks for e in self.entries.values())

    def at(self, t: float, kind: int, obj: object) -> None:
        self.n += 1
        heappush(self.heap, (t, self.n, kind, obj))

    def run(self) -> PrefixResult:
        for r in self.trace:
            self.at(r.t, ARRIVE, r)
        while self.heap:
            t, _, kind, obj = heappop(self.heap)
            if kind == ARRIVE:
                self.queue[obj.model].append(obj)  # type: ignore[attr-defined]
                self.start(obj.model, t)  # type: ignore[attr-defined]
            elif kind == PREFILLED:
                self.busy[obj] = False  # type: ignore[index]
                self.start(obj, t)  # type: ignore[arg-type]
            else:
                self.finish(obj, t)  # type: ignore[arg-type]
        return self.result

    # --- requests -----------------------------------------------------------------------------
    def start(self, inst: str, t: float) -> None:
        if self.busy[inst] or not self.queue[inst]:
            return
        r = self.queue[inst][0]
        entry = self.entries.get((inst, r.prefix)) if self.arm != "off" else None
        private = self.blocks(r.suffix_tokens + r.output) + (0 if self.arm != "off" else self.blocks(r.prefix_tokens))
        need = private + (0 if entry is not None else (self.blocks(r.prefix_tokens) if self.arm != "off" else 0))
        if self.free < need:
            self.release(need - self.free, t, keep=entry)
            if self.free < need:
                return  # waits for running requests to end
        self.queue[inst].popleft()
        pb, was_hit = self.blocks(r.prefix_tokens), entry is not None
        self.lookups.append((t, inst, r.prefix, pb, pb if was_hit else 0))
        self.result.looked_up[inst] += pb
        if was_hit:
            self.result.hit[inst] += pb
        elif self.arm != "off":
            entry = Entry(inst, r.prefix, self.blocks(r.prefix_tokens), r.prefix_tokens)
            self.entries[(inst, r.prefix)] = entry
        if entry is not None:
            entry.refs += 1
            entry.last_used = t
        self.live += private
        tokens = r.suffix_tokens + (0 if was_hit else r.prefix_tokens)
        end = t + self.cost.step_s(0, 0, tokens)
        self.result.ttft[inst].append(end - r.t)
        self.busy[inst] = True
        self.at(end, PREFILLED, inst)
        self.at(end + r.output * self.tpot, FINISH, (r, entry, private))

    def finish(self, obj: tuple[PrefixRequest, Entry | None, int], t: float) -> None:
        r, entry, private = obj
        self.live -= private
        self.frees.append((t, private))
        if entry is not None:
            entry.refs -= 1
            entry.last_used = t
        for inst in self.queue:
            self.start(inst, t)

    # --- releasing cached prefixes ---------------------------------------------------------------
    def release(self, short: int, t: float, keep: Entry | None) -> None:
        cached = sorted((e for e in self.entries.values() if e.refs == 0 and e is not keep),
                        key=lambda e: e.last_used)  # least recently used first
        before = dict(self.result.released)
        self.choose(cached, short, t)
        if self.result.released["chat"] > before.get("chat", 0) and any(
                e.instance == "rag" and e.refs == 0 and e is not keep for e in self.entries.values()):
            self.result.chat_before_rag += 1

    def choose(self, cached: list[Entry], short: int, t: float) -> None:
        if self.arm == "lru":
            self.drop_until(cached, short)
            return
        self.trim(t)
        bb = self.bs * self.token_bytes
        pf = self.cost.prefill_per_token_s
        offers: list[Offer] = []
        if self.arm == "prefix":
            for e in cached:
                n = sum(1 for x in self.lookups if x[1] == e.instance and x[2] == e.prefix)
                chance = (n - 1) / n if n > 1 else 0.0
                offers.append(Offer("prefix", f"{e.instance}/{e.prefix}", e.blocks * bb,
                                    price_prefix_eviction(chance, e.tokens, pf), [e]))
        else:
            for inst in self.queue:
                mine = [e for e in cached if e.instance == inst]
                q = sum(x[3] for x in self.lookups if x[1] == inst)
                h = sum(x[4] for x in self.lookups if x[1] == inst)
                if mine:
                    offers.append(Offer("prefix", inst, sum(e.blocks for e in mine) * bb,
                                        price_prefix_eviction(reuse_chance(q, h), sum(e.tokens for e in mine), pf),
                                        mine, divisible=True))
        waiting = sum(len(q) for q in self.queue.values())
        drain = sum(b for _, b in self.frees) * bb / self.window_s if self.live else 0.0
        purchase = buy(Need("worker:w0", short * bb, self.horizon_s, max(1, waiting), drain), offers)
        for o in purchase.bought:
            self.drop_until(o.payload, -(-o.bytes // bb))  # type: ignore[arg-type]

    def drop_until(self, entries: list[Entry], blocks: int) -> None:
        got = 0
        for e in entries:
            if got >= blocks:
                break
            del self.entries[(e.instance, e.prefix)]
            self.result.released[e.instance] += 1
            got += e.blocks

    def trim(self, t: float) -> None:
        while self.lookups and self.lookups[0][0] < t - self.window_s:
            self.lookups.popleft()
        while self.frees and self.frees[0][0] < t - self.window_s:
            self.frees.popleft()


def run_prefix_economy(params: PrefixTraceParams, arm: str, *, profile: str = "a100-7b",
                       capacity_blocks: int = 3000) -> PrefixResult:
    return PrefixEconomySim(prefix_trace(params), arm, load_profile(profile), capacity_blocks=capacity_blocks).run()


def headline(results: dict[str, PrefixResult]) -> str:
    off, lru, pr = results["off"], results["lru"], results["instance"]
    return (f"prefix sim: chat_hit_rate lru={lru.hit_rate('chat'):.0%} priced={pr.hit_rate('chat'):.0%} "
            f"p50_ttft_cut_vs_off={off.p(50) / pr.p(50):.1f}x "
            f"chat_p99_ttft lru/priced={lru.p(99, 'chat') / pr.p(99, 'chat'):.2f}x "
            f"chat_prompts_released lru={lru.released['chat']} priced={pr.released['chat']} "
            f"chat_before_rag lru={lru.chat_before_rag} priced={pr.chat_before_rag}")


def table(results: dict[str, PrefixResult]) -> list[str]:
    """One row per arm: hit rates, TTFT, prefixes released, chat prompts released while a document stayed."""
    rows = [f"{'arm':9} {'chat hit':>8} {'rag hit':>8} {'P50 TTFT':>9} {'P99 TTFT':>9} {'chat P99':>9} "
            f"{'released chat/rag':>18} {'chat before rag':>15}"]
    for arm, r in results.items():
        rows.append(f"{arm:9} {r.hit_rate('chat'):8.1%} {r.hit_rate('rag'):8.1%} {r.p(50) * 1e3:7.0f}ms "
                    f"{r.p(99) * 1e3:7.0f}ms {r.p(99, 'chat') * 1e3:7.0f}ms "
                    f"{r.released['chat']:>12}/{r.released['rag']:<5} {r.chat_before_rag:>15}")
    return rows


def run_arms(params: PrefixTraceParams, *, profile: str = "a100-7b",
             capacity_blocks: int = 3000) -> dict[str, PrefixResult]:
    return {arm: run_prefix_economy(params, arm, profile=profile, capacity_blocks=capacity_blocks) for arm in ARMS}


def _main() -> None:
    ap = argparse.ArgumentParser(description="cached prefixes on one worker: released by price or by recency")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", type=int, default=3000, help="KV blocks of the worker")
    ap.add_argument("--profile", default="a100-7b")
    args = ap.parse_args()
    results = run_arms(PrefixTraceParams(seed=args.seed, duration_s=args.minutes * 60), profile=args.profile,
                       capacity_blocks=args.capacity)
    print("\n".join(table(results)))
    print(headline(results))


if __name__ == "__main__":
    _main()


__all__ = ["ARMS", "PrefixEconomySim", "PrefixResult", "headline", "run_arms", "run_prefix_economy", "table"]
