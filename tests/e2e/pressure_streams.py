"""Helpers of the KV-pressure e2e modules (test_e2e_planner_pressure, test_e2e_migration_full_destination):
a worker's KV capacity from its stats, seeded submissions on NATS, token-exact checks against the oracle."""
from __future__ import annotations

import time

from e2e.assets import BLOCK_TOKENS, LLAMA, Oracle
from e2e.observer import Observer
from shared.bus import Bus
from shared.events import SamplingParams, SubmitAccepted, SubmitReply, SubmitRequest, WorkerStats
from shared.subjects import dispatch_submit


def kv_tokens(observer: Observer, worker: str) -> tuple[int, str]:
    """(the KV tokens the worker's LLAMA instance can hold, its instance id), from its latest stats."""
    stats: WorkerStats = [s for _at, s in observer.stats if s.worker_id == worker][-1]
    (inst,) = [i for i in stats.instances if i.model == LLAMA]
    return inst.kv_blocks_total * BLOCK_TOKENS // (inst.layers.end - inst.layers.start), inst.instance_id


async def submit(bus: Bus, rid: str, ids: list[int], sampling: SamplingParams) -> None:
    msg = SubmitRequest(request_id=rid, model=LLAMA, prompt_token_ids=ids, sampling=sampling, arrival_ts=time.time())
    assert isinstance(await bus.request(dispatch_submit(), msg, SubmitReply), SubmitAccepted)


def assert_exact(observer: Observer, oracle: Oracle, rid: str, ids: list[int], sampling: SamplingParams) -> None:
    from services.gpu_worker.engine.sampling_params import SamplingParams as EngineSampling

    chunks = sorted(observer.chunks(rid), key=lambda c: c.seq)
    assert [c.seq for c in chunks] == list(range(len(chunks))), f"{rid}: a gap or a duplicate"
    (want,) = oracle._engine(LLAMA).generate([ids], EngineSampling(
        temperature=sampling.temperature, seed=sampling.seed, max_tokens=sampling.max_tokens, ignore_eos=True))
    assert tuple(t for c in chunks for t in c.token_ids) == tuple(want.token_ids), rid


async def finished(observer: Observer, rids: list[str], timeout: float = 180.0) -> None:
    await observer.wait_for(lambda: all(any(c.final for c in observer.chunks(r)) for r in rids), timeout=timeout)
