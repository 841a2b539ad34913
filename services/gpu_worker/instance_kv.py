"""The engine-thread side of a live KV migration (services/gpu_worker/migration_kv.py drives it).

Each function runs on an instance's engine thread between two steps (`ModelInstance.run_on_engine`),
given the engine and the instance's `StreamEncoder`: a request's stream moves with its KV, so the
two change together or not at all.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.gpu_worker.engine.engine import DetachedRequest, KvProgress, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine_params import engine_params
from services.gpu_worker.stream import Payload, StreamEncoder
from shared.events import Assignment


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """A running request's KV progress and views of the full blocks asked for (migration)."""

    progress: KvProgress
    views: list[object]


@dataclass(frozen=True, slots=True)
class Stopped:
    """A request taken out for the final stop of a KV migration, its blocks still held."""

    detached: DetachedRequest
    next_seq: int  # its stream's next chunk
    first_block: int  # views: blocks [first_block, last_block) on every layer, still to send
    last_block: int
    views: list[object]
    stopped_at: float  # time.monotonic() when it left the engine


def snapshot(engine: LLMEngine, encoder: StreamEncoder, request_id: str, first_block: int) -> KvSnapshot | None:
    """The request's progress and views of its full blocks [first_block, full_blocks) (sent while
    it keeps decoding: full blocks never change); None if it is not running here."""
    progress = engine.kv_progress(request_id)
    if progress is None or request_id not in encoder.streams:
        return None
    last = max(first_block, progress.full_blocks)
    return KvSnapshot(progress, engine.kv_views(request_id, first_block, last) if last > first_block else [])


def stop_for_handover(engine: LLMEngine, encoder: StreamEncoder, flush: Callable[[Payload], None], request_id: str,
                      sent_blocks: int, preemptions: int) -> Stopped | None:
    """The final stop: take the request out keeping its KV blocks (no final chunk; its coalesced
    tokens go to `flush` now) with views of the blocks still to send. Those are [sent_blocks,
    blocks covering its computed tokens) — at least the last of them, so a final transfer always
    happens — or from 0 when a preemption since the pre-copy (`preemptions` differs) made the
    copied blocks stale. None if it ended."""
    progress = engine.kv_progress(request_id)
    if progress is None or request_id not in encoder.streams:
        return None
    detached = engine.detach(request_id, keep_kv=True)
    assert detached is not None
    stopped_at = time.monotonic()
    taken = encoder.detach(request_id)
    assert taken is not None
    flushed, next_seq = taken
    if flushed is not None:  # its coalesced tokens go out before the destination continues the stream
        flush(flushed)
    bs = engine.blocks.block_size
    last = -(-detached.num_computed_tokens // bs)
    stale = progress.num_preemptions != preemptions or detached.num_computed_tokens < sent_blocks * bs
    first = 0 if stale else min(sent_blocks, max(0, last - 1))  # the last block always goes in the stop
    views = engine.kv_views(request_id, first, last) if last > first else []
    return Stopped(detached, next_seq, first, last, views, stopped_at)


def resume_detached(engine: LLMEngine, encoder: StreamEncoder, detached: DetachedRequest, next_seq: int,
                    epoch: tuple[int, int] = (0, 0)) -> None:
    """Run a request `stop_for_handover` took out here again, on its held blocks (a failed move)."""
    _attach_with_stream(engine, encoder, detached.request_id, next_seq, detached.prompt_token_ids, detached.params,
                        output_token_ids=detached.output_token_ids,
                        num_computed_tokens=detached.num_computed_tokens, adapter=detached.adapter,
                        priority=detached.priority, epoch=epoch)


def reserve(engine: LLMEngine, request_id: str, num_tokens: int, expected_tokens: int, first_block: int,
            last_block: int) -> list[object] | None:
    """Destination: hold blocks for `num_tokens` (grown on repeat calls) and return views of
    [first_block, last_block) to receive into; None if there is no room."""
    if engine.reserve_kv(request_id, num_tokens, expected_tokens=expected_tokens) is None:
        return None
    return list(engine.kv_views(request_id, first_block, last_block)) if last_block > first_block else []


def attach(engine: LLMEngine, encoder: StreamEncoder, a: Assignment) -> None:
    """Destination's commit: admit `a` on the blocks reserved for it, its stream opened at
    `a.next_seq`. Raises ValueError/SamplingParamsError (nothing changed) if it cannot."""
    _attach_with_stream(engine, encoder, a.request_id, a.next_seq, list(a.prompt_token_ids), engine_params(a.sampling),
                        output_token_ids=list(a.resume_token_ids), num_computed_tokens=a.kv_computed_tokens,
                        adapter=a.adapter, priority=-a.priority, epoch=(a.attempt, a.handover))


def _attach_with_stream(engine: LLMEngine, encoder: StreamEncoder, request_id: str, next_seq: int,
                        prompt_token_ids: list[int], params: SamplingParams, *, output_token_ids: list[int],
                        num_computed_tokens: int, adapter: str | None, priority: int,
                        epoch: tuple[int, int]) -> None:
    """Open the request's stream and admit it on its held blocks; on a refusal, neither stays."""
    encoder.open(request_id, next_seq, params.logprobs is not None, epoch)
    try:
        engine.attach(request_id, prompt_token_ids, params, output_token_ids=output_token_ids,
                      num_computed_tokens=num_computed_tokens, adapter=adapter, priority=priority)
    except ValueError:
        encoder.streams.pop(request_id, None)
        raise
