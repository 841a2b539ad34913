"""The worker's prefix-summary publisher: when a summary is due (on change, at most once per interval,
an unchanged one every max_silence), what it carries (capped, most recent first), and one tick over
instances read through the PrefixCache interface (no NATS: `publish` collects)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from shared.events import PrefixSummary
from shared.events.worker import MAX_PREFIX_HASHES
from services.gpu_worker.prefix_publisher import PrefixPublisher, Reading, Sent, due, read, summary


@dataclass
class Cache:
    """What the publisher reads of the engine's PrefixCache (the agreed interface)."""

    block_size: int = 16
    held: list[int] = field(default_factory=list)
    queried: int = 0
    hits: int = 0
    free: int = 0

    def held_hashes(self) -> list[int]:
        return list(self.held)

    def hit_stats(self) -> tuple[int, int]:
        return self.queried, self.hits

    def cached_free_blocks(self) -> int:
        return self.free


@dataclass
class Engine:
    prefix_cache: Cache | None


@dataclass
class Instance:
    model: str
    engine: Engine


R = Reading(block_size=16, hashes=(3, 2, 1), held=3, cached_free=1, queried=10, hits=4)


def test_due_on_change_at_a_bounded_rate_and_unchanged_after_max_silence() -> None:
    assert due(None, R, 0.0)
    last = Sent(R, at=10.0, seq=0)
    changed = Reading(block_size=16, hashes=(4, 3, 2, 1), held=4, cached_free=1, queried=12, hits=4)
    assert not due(last, changed, 10.1, interval=0.25, max_silence=2.0)  # changed, but too soon
    assert due(last, changed, 10.3, interval=0.25, max_silence=2.0)
    assert not due(last, R, 11.0, interval=0.25, max_silence=2.0)  # unchanged, within max_silence
    assert due(last, R, 12.0, interval=0.25, max_silence=2.0)


def test_a_reading_is_capped_most_recent_first_and_the_summary_round_trips() -> None:
    cache = Cache(held=list(range(MAX_PREFIX_HASHES + 10, 0, -1)) + [2**64 - 1], queried=7, hits=3, free=5)
    r = read(cache)
    assert r.hashes[0] == MAX_PREFIX_HASHES + 10 and len(r.hashes) == MAX_PREFIX_HASHES
    assert r.held == MAX_PREFIX_HASHES + 11 and (r.queried, r.hits, r.cached_free) == (7, 3, 5)
    msg = summary("w0", "i0", "m", 4, 1.5, r)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=PrefixSummary)
    assert back == msg and back.hit_blocks == 3 and len(back.hashes) == MAX_PREFIX_HASHES


def test_a_tick_sends_per_instance_on_change_and_skips_caching_off() -> None:
    sent: list[PrefixSummary] = []

    async def publish(msg: PrefixSummary) -> None:
        sent.append(msg)

    cache = Cache(held=[5, 6])
    now = [0.0]
    instances = {"i0": Instance("m", Engine(cache)), "i1": Instance("q", Engine(None))}
    pub = PrefixPublisher("w0", instances, publish, interval=0.25, max_silence=2.0, clock=lambda: now[0])

    async def run() -> None:
        assert await pub.tick() == 1  # i1 caches nothing: no summary
        now[0] = 0.5
        assert await pub.tick() == 0  # unchanged
        cache.held.insert(0, 7)
        cache.queried, cache.hits = 4, 2
        assert await pub.tick() == 1
        now[0] = 3.0
        assert await pub.tick() == 1  # unchanged, past max_silence

    asyncio.run(run())
    assert [(m.instance_id, m.seq, m.hashes) for m in sent] == [("i0", 0, [5, 6]), ("i0", 1, [7, 5, 6]),
                                                                ("i0", 2, [7, 5, 6])]
    assert sent[1].hit_blocks == 2 and sent[1].queried_blocks == 4


def test_the_engines_prefix_cache_reads_through_the_interface() -> None:
    import threading

    from services.gpu_worker.engine.prefix_cache import PrefixCache

    cache = PrefixCache(block_size=16, model="m", layers=(0, 1), lock=threading.RLock(), release=lambda ids: None)
    r = read(cache)
    assert r == Reading(block_size=16, hashes=(), held=0, cached_free=0, queried=0, hits=0)
