"""Builders for the dispatcher core's unit tests: messages as workers and gateways send them."""
from __future__ import annotations

from shared.config import parse_config
from shared.events import (
    InstanceStats, LayerRange, PoolBreakdown, SamplingParams, SubmitRequest, TokenChunk, Usage, WorkerHeartbeat,
    WorkerState, WorkerStats,
)
from shared.policy.routing_policies import make_policy

from services.dispatcher.core import DispatchCore
from services.dispatcher.effects import SendAssignment
from services.dispatcher.model_catalog import ModelCatalog

CONFIG = parse_config("""
[[models]]
name = "m"
path = "/models/m"
max_context = 256

[[models]]
name = "q"
path = "/models/q"
max_context = 128

[[adapters]]
name = "m-lora"
base = "m"
path = "/adapters/m-lora"
""")

DEAD_AFTER = 3.0


def core(*, queue_bound: int = 4, max_redispatches: int = 2, max_batch: int = 2) -> DispatchCore:
    return DispatchCore(
        dispatcher_id="dispatcher-test", policy=make_policy("least-load"), catalog=ModelCatalog.from_config(CONFIG),
        queue_bound=queue_bound, max_redispatches=max_redispatches, dead_after=DEAD_AFTER, block_size=16,
        max_batch=max_batch, now=0.0,
    )


def submit(rid: str, *, model: str = "m", adapter: str | None = None, prompt: int = 8, max_tokens: int = 16,
           priority: int = 0, deadline: float | None = None) -> SubmitRequest:
    return SubmitRequest(
        request_id=rid, model=model, adapter=adapter, prompt_token_ids=list(range(1, prompt + 1)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), priority=priority, arrival_ts=0.0,
        deadline_ts=deadline,
    )


def instance(iid: str, *, model: str = "m", running: int = 0, waiting: int = 0, used: int = 0,
             total: int = 64, adapters: tuple[str, ...] = ("m-lora",)) -> InstanceStats:
    """`adapters`: registered on the instance (routable there); `stats(adapters=...)`: resident."""
    return InstanceStats(instance_id=iid, model=model, layers=LayerRange(start=0, end=2), running=running,
                         waiting=waiting, kv_blocks_used=used, kv_blocks_total=total, adapters=list(adapters))


def stats(worker: str, *instances: InstanceStats, state: WorkerState = WorkerState.READY,
          adapters: tuple[str, ...] = ()) -> WorkerStats:
    return WorkerStats(worker_id=worker, seq=0, ts=0.0, device="cpu", state=state,
                       pool=PoolBreakdown(capacity_bytes=1 << 20), instances=list(instances),
                       resident_adapters=list(adapters))


def heartbeat(worker: str, incarnation: str = "inc-1", state: WorkerState = WorkerState.READY) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker, incarnation=incarnation, seq=0, ts=0.0, state=state)


def chunk(rid: str, seq: int, tokens: list[int], worker: str, *, final: bool = False, prompt: int = 8,
          attempt: int = 0) -> TokenChunk:
    usage = Usage(prompt_tokens=prompt, completion_tokens=seq + len(tokens)) if final else None
    return TokenChunk(request_id=rid, seq=seq, token_ids=tokens, worker_id=worker,
                      finish_reason="length" if final else None, usage=usage, attempt=attempt)


def two_workers(c: DispatchCore, now: float = 0.0) -> None:
    """w0 (instance i0) and w1 (instance i1), both serving model m, idle and heard from."""
    for worker, iid in (("w0", "i0"), ("w1", "i1")):
        c.heartbeat(heartbeat(worker), now)
        c.worker_stats(stats(worker, instance(iid)), now)


def sends(effects: list) -> list[SendAssignment]:
    return [e for e in effects if isinstance(e, SendAssignment)]
