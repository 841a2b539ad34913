"""LLMEngine: requests in, per-step output deltas out. The step is schedule → execute →
sample → postprocess; everything else (blocks, batching, KV, LoRA) lives in its own part.

One owner drives an engine (the gpu_worker's actor, or `generate` offline): add_request,
abort and step are called from that owner only, between steps. The live-migration calls
(kv_progress, detach, reserve_kv, attach, release_kv, kv_views) are in `kv_handover`.
Engines of one worker share one `MemoryPool` (each charging it through a view named by
its tenant, the instance id): their KV blocks move between them on demand
(`block_manager`), each engine stepping on its own thread.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from services.gpu_worker.engine.batch import SchedulerOutput
from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.cold_start import ColdStart
from services.gpu_worker.engine.cpu_lora_helpers import CpuLoRAFailed
from services.gpu_worker.engine.detokenizer import IncrementalDetokenizer
from services.gpu_worker.engine.kv_handover import DetachedRequest, KvHandover, KvProgress
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool, PoolView
from services.gpu_worker.engine.preloaded import PreloadedWeights
from services.gpu_worker.engine.model_runner import ModelRunner
from services.gpu_worker.engine.outputs import CompletionResult, RequestOutput
from services.gpu_worker.engine.sampler import SampleResult, Sampler
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.scheduler import Scheduler, SchedulerConfig
from services.gpu_worker.engine.sequence import FinishReason, Sequence
from services.gpu_worker.engine.tokenizer import EngineTokenizer

__all__ = ["DetachedRequest", "EngineConfig", "KvProgress", "LLMEngine"]

LOAD_WAIT_S = 0.005  # a step with nothing to run but chunks waiting for adapter loads: wait this long for one


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    pool_bytes: int | None = None  # CPU: a setting (default 2x the checkpoint + 1 GiB); CUDA: 90% of free HBM
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_prefill_chunk: int = 0
    scheduling_policy: str = "chunked"  # or "vllm-0.6" (scheduler.py, docs/engine-scheduling.md)
    dtype: str | None = None  # default: the checkpoint's
    device: str = "cpu"
    lora_mode: str = "segmented"  # or "padded"
    max_loras: int | None = None
    num_threads: int | None = None
    workspace_bytes: int | None = None  # default: estimated from the step's largest shapes
    kv_blocks: int | None = None  # cap on KV blocks (tests, reproducible pressure); default: all the pool gives
    # CaraServe (cold_start.py): a cold adapter's prefill runs on CPU helpers while it loads
    cpu_lora_assist: bool = False
    cpu_lora_processes: int = 2
    lora_load_bandwidth: float | None = None  # bytes/s: paces adapter loads (a PCIe-like link on CPU)
    # "auto": per cold request CPU assist, async or inline by T_cpu < X + P (cold_start.py); "async"; or
    # "inline": the step that needs a cold adapter loads it, the batch waits
    lora_load_mode: str = "async"
    lora_page_lock: bool = True  # CUDA: adapters' host copies page-locked (faster, asynchronous loads)
    cpu_lora_pace: float = 0.0  # s per cold row x rank of a helper call: a slower CPU's stand-in (bench); 0: none
    cpu_lora_chunk: int = 32  # tokens per CPU-assisted prefill chunk (the device takes over at the next)
    cpu_lora_cores: tuple[int, ...] = ()  # CPUs the helpers are pinned to (one each, round robin); () unpinned
    # automatic prefix caching (prefix_cache.py, docs/engine-scheduling.md); blocks are named under
    # `model_name` (default: the model dir's name), the name the dispatcher hashes requests with
    prefix_caching: bool = True
    model_name: str | None = None


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None


class LLMEngine(KvHandover):
    def __init__(self, config: EngineConfig, pool: MemoryPool | None = None, *, tenant: str | None = None,
                 preloaded: PreloadedWeights | None = None, background_load: bool = False) -> None:
        """`pool`: the device's pool shared with other engines (default: a private one of
        `config.pool_bytes`); `tenant` names this engine's charges in it (default: the model dir's name).
        `preloaded`: weights already in device memory (no copy, no checkpoint read for them);
        `background_load`: the layers not preloaded load while the engine steps (engine/preloaded.py)."""
        self.config = config
        model_dir = Path(config.model_dir)
        root = pool if pool is not None else MemoryPool(_pool_bytes(config), config.device)
        self.pool: PoolView = root.view(tenant or model_dir.name or "engine")
        self.tokenizer = EngineTokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        self.runner = ModelRunner(
            model_dir, self.pool, block_size=config.block_size, dtype=config.dtype, device=config.device,
            lora_mode=config.lora_mode, max_loras=config.max_loras, num_threads=config.num_threads,
            preloaded=preloaded, background_load=background_load,
        )
        cfg = self.runner.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position, cfg.max_position)
        workspace = config.workspace_bytes if config.workspace_bytes is not None else self._workspace_estimate()
        self.pool.charge(MemoryKind.WORKSPACE, f"{cfg.name}:activations", workspace)
        self.blocks = BlockManager(
            self.pool, block_size=config.block_size, block_bytes=self.runner.kv_block_bytes,
            layers=self.runner.kv_layers, owner=f"{cfg.name}:kv",
            max_blocks=min(self.runner.max_kv_blocks, config.kv_blocks or self.runner.max_kv_blocks),
            on_retire=self.runner.kv_cache.release_blocks,  # blocks given to others cost this engine no memory
            on_grow=self.runner.kv_cache.back_blocks,  # CUDA VMM: map memory behind new ids before use
            prefix_model=(config.model_name or model_dir.name or "model") if config.prefix_caching else None,
        )
        self.prefix_cache = self.blocks.prefix  # None when caching is off
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.max_prefill_chunk,
                            policy=config.scheduling_policy),
            self.blocks,
        )
        eos = set(cfg.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        self.eos_token_ids = frozenset(eos)
        self.sampler = Sampler(self.tokenizer, self.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step
        self._order = itertools.count()
        self._sampled_ids: list[str] = []  # row order of the last step's sampled logits
        self._held_kv: set[str] = set()  # ids whose blocks are held outside the scheduler (migration)
        self.stalled = False  # the last step scheduled nothing although requests are in (e.g. waiting for KV)
        # prefill pace (cumulative): prompt tokens computed in chunks of more than one token, and the wall time
        # of the steps that held them -- the planner's measured budget for re-prefilling a moved request
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.cold = ColdStart(self.runner, assist=config.cpu_lora_assist, processes=config.cpu_lora_processes,
                              bandwidth=config.lora_load_bandwidth, model_dir=config.model_dir, dtype=config.dtype,
                              max_rows=config.max_num_batched_tokens, load_mode=config.lora_load_mode,
                              cpu_chunk=config.cpu_lora_chunk, cores=config.cpu_lora_cores,
                              page_lock=config.lora_page_lock, cpu_pace=config.cpu_lora_pace)

    # --- requests --------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. `resume_token_ids`: outputs another engine already produced (a
        re-dispatch): they are prefilled with the prompt, count toward max_tokens, are not
        returned again, and generation continues as if this engine had made them."""
        self._check_new_id(request_id)
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model_dir} has no tokenizer.json: pass prompt token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        req = self._make_request(request_id, token_ids, params, list(resume_token_ids or ()), adapter, priority, arrival_time)
        self.scheduler.add(req.seq)
        self._requests[request_id] = req

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if request_id in self._held_kv:
            raise ValueError(f"request id {request_id!r} holds KV blocks here (a migration): attach or release_kv it")

    def _make_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, outputs: list[int],
        adapter: str | None, priority: int, arrival_time: float | None,
    ) -> _Request:
        """A validated sequence (with `outputs` already made elsewhere) and its detokenizer,
        caught up on those outputs; touches no engine state."""
        vocab = self.runner.cfg.vocab_size
        bad = [t for t in token_ids + outputs if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if adapter is not None and adapter not in self.runner.lora.host:
            raise ValueError(f"request {request_id}: unknown LoRA adapter {adapter!r}; add it with add_lora first")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id}: prompt has {len(token_ids)} tokens, more than the context length {self.max_model_len}"
            )
        if outputs and (len(outputs) >= params.max_tokens or len(token_ids) + len(outputs) >= self.max_model_len):
            raise ValueError(
                f"request {request_id}: {len(outputs)} resumed tokens leave nothing to generate "
                f"(max_tokens {params.max_tokens}, context {self.max_model_len})"
            )
        seq = Sequence(
            seq_id=request_id, prompt_token_ids=token_ids, params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            arrival_order=next(self._order), priority=priority, adapter=adapter, eos_token_ids=self.eos_token_ids,
        )
        seq.output_token_ids.extend(outputs)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params) if self.tokenizer else None
        if detok is not None:
            for token in outputs:  # same state as the engine that emitted them; their text is not repeated
                detok.add(token)
        return _Request(seq, detok)

    def abort(self, request_id: str) -> bool:
        """Stop a request now: its KV blocks are free before the next step."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        self.sampler.forget(request_id)
        self._pending.append(self._output(req, [], "", None))
        return True

    def add_lora(self, name: str, path: str | Path) -> None:
        self.runner.lora.register(name, path)
        if self.prefix_cache is not None:  # the name may now stand for other weights: its cached KV is stale
            self.prefix_cache.invalidate(name, everything=False)

    def remove_lora(self, name: str) -> None:
        self.runner.lora.unregister(name)
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate(name, everything=False)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.stalled = out.is_empty and bool(self._requests)
        held = self._load_adapters(out)
        if held and out.is_empty:  # every chunk waits for an adapter's load: wait for one to land
            self.cold.wait_for_load(LOAD_WAIT_S)
        started = time.perf_counter()
        sampled = self._execute(out)
        prefilled = sum(len(c.token_ids) for c in out.chunks if len(c.token_ids) > 1)
        if prefilled:
            self.prefill_tokens += prefilled
            self.prefill_s += time.perf_counter() - started
        changed = self.scheduler.update(out, sampled.token_ids)
        return self._postprocess(changed, sampled)

    def _load_adapters(self, out: SchedulerOutput) -> bool:
        """Make the step's adapters resident (or start their loads and prefill on CPU meanwhile:
        `cold_start`). If live KV of other sequences holds the bytes, the sequences of the
        adapters that do not fit sit this step out (preempted, freeing their blocks); if they
        hold all the live KV themselves, they never fit: error. True if chunks wait for loads."""
        before = len(out.chunks)
        missing, error = self.cold.route(out, lambda seq_id: self._requests[seq_id].seq)
        if not missing:
            return len(out.chunks) < before
        waiting = [c.seq_id for c in out.chunks if c.adapter in missing]
        # Alone: no other sequence holds KV that could be freed later, so it never fits. The
        # failed charge took every free KV block of the shared pool: other instances' KV left is live.
        others_kv = self.pool.root.bytes_of(MemoryKind.KV) - self.blocks.num_blocks * self.blocks.block_bytes
        mine = {b for s in waiting if self.blocks.has(s) for t in self.blocks.block_tables(s).values() for b in t}
        alone = self.blocks.num_used_blocks == len(mine) and others_kv <= 0  # shared prefix blocks counted once
        for seq_id in waiting:
            if alone:
                self.scheduler.finish(seq_id, FinishReason.ERROR, error=error)
                req = self._requests.pop(seq_id)
                self.sampler.forget(seq_id)
                self._pending.append(self._output(req, [], "", None))
            else:
                self.scheduler.preempt(seq_id)
        out.chunks = [c for c in out.chunks if c.adapter not in missing]
        return False

    def _execute(self, out: SchedulerOutput) -> SampleResult:
        for seq_id in out.finished:
            self.sampler.forget(seq_id)
        self._sampled_ids: list[str] = []
        if out.is_empty:
            return SampleResult([])
        started = time.perf_counter()
        try:
            result = self.runner.execute(out)
        except CpuLoRAFailed as exc:  # a helper died or erred: those requests wait for the load
            self.cold.fall_back(out, exc)
            if out.is_empty:
                return SampleResult([])
            result = self.runner.execute(out)
        if result.logits is None:  # chunks that sample nothing (e.g. a CPU-assisted chunk cut short)
            self.cold.observe(out, started, synced=False)
            return SampleResult([])
        self._sampled_ids = result.sampled_seq_ids
        seqs = [self._requests[s].seq for s in result.sampled_seq_ids]
        # The index of the token being drawn: seeded noise depends on it, not on history.
        indices = [seq.num_output_tokens for seq in seqs]
        sampled = self.sampler.sample(result.logits, result.sampled_seq_ids, [seq.params for seq in seqs], indices,
                                      [seq.output_token_ids for seq in seqs], [seq.prompt_token_ids for seq in seqs])
        self.cold.observe(out, started)  # the cold-start rule's P or T_cpu (the sample synced the device)
        return sampled

    def _postprocess(self, changed: list[Sequence], sampled: SampleResult) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        row = {seq_id: i for i, seq_id in enumerate(self._sampled_ids)} if any(lp is not None for lp in sampled.logprobs) else {}
        for seq in changed:
            req = self._requests.get(seq.seq_id)
            if req is None:
                continue
            new_ids = [seq.output_token_ids[-1]] if seq.finish_reason is not FinishReason.ERROR else []
            text = ""
            if req.detok is not None:
                stopped_by_token = seq.finish_reason is FinishReason.STOP  # stop strings come below
                if new_ids and not (stopped_by_token and not seq.params.include_stop_str_in_output):
                    text = req.detok.add(new_ids[0])
                if req.detok.stop_string is not None and not seq.is_finished:
                    self.scheduler.finish(seq.seq_id, FinishReason.STOP, req.detok.stop_string)
                if seq.is_finished and req.detok.stop_string is None:
                    text += req.detok.flush()  # held-back text is no stop string after all
            i = row.get(seq.seq_id)
            outputs.append(self._output(req, new_ids, text, i, sampled))
            if seq.is_finished:
                del self._requests[seq.seq_id]
                self.sampler.forget(seq.seq_id)
        return outputs

    def _output(self, req: _Request, new_ids: list[int], text: str, row: int | None, sampled: SampleResult | None = None) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished or seq.seq_id not in self._requests
        out = RequestOutput(
            request_id=seq.seq_id, new_token_ids=new_ids, new_text=text, finished=finished,
            finish_reason=(seq.finish_reason.value if seq.finish_reason else "abort") if finished else None,
            stop_reason=seq.stop_reason, prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens, num_preemptions=seq.num_preemptions, error=seq.error,
        )
        if row is not None and sampled is not None and sampled.logprobs[row] is not None:
            out.logprobs = [sampled.logprobs[row]]
            top = sampled.top_logprobs[row]
            out.top_logprobs = [top] if top is not None else None
        return out

    # --- offline ---------------------------------------------------------------------
    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        *, adapters: list[str | None] | None = None,
    ) -> list[CompletionResult]:
        """Run prompts to completion; results in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, CompletionResult] = {}
        for i, prompt in enumerate(prompts):
            rid = f"generate-{next(self._order)}"
            self.add_request(rid, prompt, plist[i], adapter=adapters[i] if adapters else None)
            results[rid] = CompletionResult(rid, list(self._requests[rid].seq.prompt_token_ids))
        while self.has_unfinished:
            for delta in self.step():
                if delta.request_id in results:
                    results[delta.request_id].add(delta)
        return list(results.values())

    # --- residency and stats ----------------------------------------------------------
    def drop_layers(self, start: int, end: int) -> int:
        """Free layers' weights; the bytes are KV blocks from the next step on."""
        return self.runner.drop_layers(start, end)

    def restore_layers(self, start: int, end: int, *, preempt: bool = False) -> None:
        """Load layers back. Only free KV blocks can give their bytes; with `preempt`, running
        sequences (lowest priority first) are preempted until the weights fit."""
        while True:
            try:
                return self.runner.restore_layers(start, end)
            except MemoryError:  # PoolExhausted: live KV holds the bytes
                if not preempt or self.scheduler.preempt_lowest() is None:
                    raise

    def stats(self) -> dict[str, object]:
        return {"memory": self.pool.breakdown(), **self.scheduler.stats()}

    def _workspace_estimate(self) -> int:
        cfg, c = self.runner.cfg, self.config
        item = 4 if cfg.dtype.itemsize >= 4 else 2
        per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.q_size + 2 * cfg.kv_size) * item
        logits = c.max_num_seqs * cfg.vocab_size * 4 * 3  # logits, probabilities, sampling noise
        return c.max_num_batched_tokens * per_token + logits


def _pool_bytes(config: EngineConfig) -> int:
    if config.pool_bytes is not None:
        return config.pool_bytes
    if config.device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(config.device))
        return int(free * 0.9)
    # CPU: room for the weights even if upcast from 16 bits, plus 1 GiB. Only address space
    # is reserved for KV (gpu_ext.memory), so a generous setting costs no RAM up front.
    weights = sum(f.stat().st_size for f in Path(config.model_dir).glob("*.safetensors"))
    return 2 * weights + (1 << 30)
