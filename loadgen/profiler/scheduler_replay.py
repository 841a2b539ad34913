"""The live engine's own scheduler on a virtual clock: the pressure fidelity check's middle column.

`replay` drives `services/gpu_worker/engine/scheduler.py` — the real `Scheduler` and
`BlockManager`, the policy the worker runs — through a trace on ONE worker, with no model and no
wall clock: each step takes the time the profile's `StepCost` gives for what the scheduler put
in it (decodes and their context, prefill chunks), arrivals join at step boundaries (after the
profile's per-request overhead), every sampled token is a dummy. So it has the live engine's
scheduling decisions (admission, chunking, who is preempted, KV blocks as the engine counts
them) and the simulator's step times. Against the simulator it checks the scheduling model
alone, free of the host's timing noise; against the live run it shows what timing adds.
"""
from __future__ import annotations

from dataclasses import dataclass

from loadgen.report.records import RequestRecord
from loadgen.sim.profile import CostProfile
from loadgen.traces.schema import Trace

TOKEN = 7  # every sampled token (ignore_eos: lengths are the trace's)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    records: list[RequestRecord]
    preemptions: int
    steps: int
    kv_peak: float  # the highest fraction of KV blocks in use after a step's scheduling


def replay(trace: Trace, profile: CostProfile, model: str | None = None) -> ReplayResult:
    from services.gpu_worker.engine.block_manager import BlockManager
    from services.gpu_worker.engine.memory_pool import MemoryPool
    from services.gpu_worker.engine.sampling_params import SamplingParams
    from services.gpu_worker.engine.scheduler import Scheduler, SchedulerConfig
    from services.gpu_worker.engine.sequence import Sequence

    spec = profile.worker
    cost = profile.step_cost(model or (trace.records[0].model if trace.records else ""))
    block_bytes = 64  # any size: the pool holds exactly spec.kv_blocks of them (one layer)
    blocks = BlockManager(MemoryPool(spec.kv_blocks * block_bytes), block_size=spec.block_size,
                          block_bytes=block_bytes, layers=[0])
    sched = Scheduler(SchedulerConfig(max_num_seqs=spec.max_batch, max_num_batched_tokens=spec.max_batched_tokens,
                                      max_model_len=spec.max_model_len, max_prefill_chunk=spec.max_prefill_chunk,
                                      policy=spec.engine_mode, watermark=spec.watermark), blocks)
    recs = sorted(trace.records, key=lambda r: r.arrival_s)
    ids = [r.request_id or f"req-{i}" for i, r in enumerate(recs)]
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    errors: dict[str, str] = {}
    by_id = {rid: rec for rid, rec in zip(ids, recs)}
    t, i, steps, peak, idle = 0.0, 0, 0, 0.0, 0
    decoding: set[str] = set()  # requests past their (re)compute
    while i < len(recs) or sched.has_unfinished:
        while i < len(recs) and recs[i].arrival_s + profile.request_overhead_s <= t:
            rec = recs[i]
            params = SamplingParams(max_tokens=max(1, rec.output_tokens), ignore_eos=True, temperature=0.0)
            sched.add(Sequence(seq_id=ids[i], prompt_token_ids=[TOKEN] * rec.prompt_tokens, params=params,
                               arrival_time=rec.arrival_s, arrival_order=i))
            i += 1
        out = sched.schedule()
        peak = max(peak, blocks.usage)
        if not out.chunks:  # nothing ran: everything was preempted (admission comes next step), or idle
            for seq in sched.update(out, []):
                errors[seq.seq_id], finish[seq.seq_id] = seq.error or "failed", t
            idle += 1
            if not sched.has_unfinished and i < len(recs):
                t = max(t, recs[i].arrival_s + profile.request_overhead_s)  # idle until the next arrival
            elif idle > 2 and sched.has_unfinished:
                raise RuntimeError(f"replay stalled at {t:.3f} s: {sched.num_waiting} waiting, "
                                   f"{sched.num_running} running, nothing scheduled")
            continue
        idle = 0
        decoding.difference_update(out.preempted)
        dec_n = dec_ctx = ptok = attn = 0
        for c in out.chunks:
            n = len(c.token_ids)
            if c.seq_id in decoding:  # sampled since its last (re)compute: a decode, as the simulator counts it
                dec_n += 1
                dec_ctx += c.start_pos
            else:
                ptok += n
                attn += n * (c.start_pos + n)
        t += cost.step_s(dec_n, dec_ctx, ptok, attn)
        steps += 1
        decoding.update(c.seq_id for c in out.chunks if c.sample)
        for seq in sched.update(out, [TOKEN for c in out.chunks if c.sample]):
            if seq.error:
                errors[seq.seq_id] = seq.error
                finish[seq.seq_id] = t
                continue
            first.setdefault(seq.seq_id, t)
            if seq.is_finished:
                finish[seq.seq_id] = t
    records = [RequestRecord(request_id=rid, model=rec.model, arrival_s=rec.arrival_s, prompt_tokens=rec.prompt_tokens,
                             output_tokens=rec.output_tokens, status="error" if rid in errors else "ok",
                             first_token_s=first.get(rid), finish_s=finish.get(rid, t), error=errors.get(rid))
               for rid, rec in by_id.items()]
    return ReplayResult(records=records, preemptions=sched.num_preemptions, steps=steps, kv_peak=peak)


__all__ = ["ReplayResult", "replay"]
