"""Constructed cluster views for the planner's pure tests."""
from __future__ import annotations

from shared.planner.view import ClusterView, InstanceView, RequestView, WorkerView

BLOCK = 1024  # bytes per KV block (all layers)
BLOCKS = 100  # KV blocks per instance: capacity 100 KiB


def worker(worker_id: str, requests: dict[str, int] | None = None, *, alive: bool = True, model: str = "m",
           blocks: int = BLOCKS) -> WorkerView:
    """A worker with one instance of `model`; `requests`: request id -> KV blocks held."""
    reqs = tuple(RequestView(rid, prompt_tokens=8, tokens=8 * n, kv_tokens=8 * n, kv_bytes=n * BLOCK,
                             projected_kv_bytes=n * BLOCK) for rid, n in (requests or {}).items())
    inst = InstanceView(instance_id=f"{worker_id}-{model}", model=model, worker_id=worker_id, running=len(reqs),
                        kv_blocks_total=blocks, kv_blocks_used=sum((requests or {}).values()), kv_block_bytes=BLOCK,
                        requests=reqs)
    return WorkerView(worker_id=worker_id, alive=alive, pool_capacity_bytes=blocks * BLOCK * 2, instances=(inst,))


def view(now: float, *workers: WorkerView, link: float = 1e12, prefill: float = 1e9) -> ClusterView:
    return ClusterView(now=now, workers={w.worker_id: w for w in workers}, default_link_budget_bytes=link,
                       default_prefill_budget_tokens=prefill)
