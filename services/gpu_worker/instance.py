"""One model instance: an `LLMEngine` and the dedicated thread that steps it.

The asyncio side never touches the engine. It puts commands (add, abort, stop) on a
thread-safe queue; the engine thread applies every queued command before each step (so an
abort lands within one step), steps, encodes that step's chunks (`stream.StreamEncoder`) and
hands the bytes back to the event loop in one call per step. After each step it also leaves
an immutable `InstanceSnapshot` for the stats publisher to read.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams, SamplingParamsError
from services.gpu_worker.stream import Payload, StreamEncoder
from shared.events import Assignment
from shared.events import SamplingParams as WireSamplingParams
from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.instance")

# Called on the engine thread with one step's payloads and the ids of requests that ended.
Emit = Callable[[list[Payload], list[str]], None]
Crashed = Callable[[str, BaseException], None]
SNAPSHOT_EVERY_S = 0.02  # at most this stale while busy (fresh whenever the engine goes idle)


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """The instance's load and memory at one moment (made on the engine thread)."""

    ts: float = 0.0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    tokens_emitted: int = 0  # cumulative
    steps: int = 0  # cumulative
    pool_capacity: int = 0
    pool_by_owner: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> owner -> bytes
    resident_adapters: tuple[str, ...] = ()


def engine_params(p: WireSamplingParams) -> SamplingParams:
    """The wire's sampling parameters as the engine's (raises SamplingParamsError if inconsistent)."""
    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        logprobs=p.logprobs, include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
    )


class ModelInstance:
    def __init__(self, instance_id: str, model: str, engine: LLMEngine, worker_id: str) -> None:
        self.instance_id = instance_id
        self.model = model
        self.engine = engine
        self.encoder = StreamEncoder(worker_id)
        self.num_layers = engine.runner.cfg.num_layers
        self.block_bytes = engine.blocks.block_bytes
        self.adapters = frozenset(engine.runner.lora.host)  # registered (host) adapters
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.runner.cfg.vocab_size
        self.snapshot = InstanceSnapshot()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._emit: Emit | None = None
        self._crashed: Crashed | None = None
        self._steps = 0
        self._snapshot_at = 0.0
        self._take_snapshot()

    # --- asyncio side (thread-safe) ---------------------------------------------------------
    def start(self, emit: Emit, crashed: Crashed) -> None:
        """Start the engine thread; `emit` gets each step's payloads, `crashed` an engine failure."""
        self._emit, self._crashed = emit, crashed
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.instance_id}", daemon=True)
        self._thread.start()

    def submit(self, assignment: Assignment) -> None:
        self._inbox.put(("add", assignment))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def detach(self, request_id: str) -> "asyncio.Future[tuple[list[int], int] | None]":
        """Take a request out between two steps WITHOUT ending its stream (migration): resolves
        to (its output tokens so far, its stream's next seq), or None if it already ended."""
        fut: concurrent.futures.Future[tuple[list[int], int] | None] = concurrent.futures.Future()
        self._inbox.put(("detach", (request_id, fut)))
        return asyncio.wrap_future(fut)

    @property
    def pending(self) -> int:
        """Commands queued for the engine thread (assignments accepted, not yet in the engine)."""
        return self._inbox.qsize()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop stepping (requests still in the engine are left as they are) and join the thread."""
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # --- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                payloads: list[Payload] = []
                ended: list[str] = []
                if not self._apply(block=not self.engine.has_unfinished, payloads=payloads, ended=ended):
                    return
                if self.engine.has_unfinished:
                    outputs = self.engine.step()
                    self._steps += 1
                    self.encoder.encode_outputs(outputs, payloads, ended)
                now = time.monotonic()
                if ended or now - self._snapshot_at >= SNAPSHOT_EVERY_S or not self.engine.has_unfinished:
                    self._take_snapshot(now)
                if payloads or ended:
                    assert self._emit is not None
                    self._emit(payloads, ended)
        except Exception as exc:  # the engine's state is unknown now: the worker must go
            log.exception("engine thread crashed", instance=self.instance_id)
            if self._crashed is not None:
                self._crashed(self.instance_id, exc)

    def _apply(self, *, block: bool, payloads: list[Payload], ended: list[str]) -> bool:
        """Apply queued commands (waiting for one when idle); False on stop."""
        while True:
            try:
                kind, arg = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "abort":
                self.engine.abort(str(arg))  # its final "abort" output comes with the next step
            elif kind == "detach":
                self._detach(*arg)  # type: ignore[misc]
            elif kind == "add":
                self._add(arg, payloads, ended)  # type: ignore[arg-type]

    def _detach(self, request_id: str, fut: "concurrent.futures.Future[tuple[list[int], int] | None]") -> None:
        stream = self.encoder.streams.pop(request_id, None)  # no final chunk: the stream goes on elsewhere
        req = self.engine._requests.get(request_id)  # noqa: SLF001 - the engine has no read API for this yet
        if stream is None or req is None:
            fut.set_result(None)
            return
        tokens = list(req.seq.output_token_ids)
        self.engine.abort(request_id)  # frees its blocks; its abort output finds no stream and is dropped
        fut.set_result((tokens, stream.next_seq))

    def _add(self, a: Assignment, payloads: list[Payload], ended: list[str]) -> None:
        try:
            params = engine_params(a.sampling)
            self.encoder.open(a.request_id, a.next_seq, params.logprobs is not None)
            self.engine.add_request(
                a.request_id, list(a.prompt_token_ids), params, adapter=a.adapter, priority=-a.priority,
                resume_token_ids=list(a.resume_token_ids) or None,
            )
        except (ValueError, SamplingParamsError) as exc:  # validated before acceptance; a last guard
            log.warning("engine refused an accepted request", request_id=a.request_id, error=str(exc))
            payloads.append(self.encoder.error(a.request_id, str(exc), a.next_seq))
            ended.append(a.request_id)

    def _take_snapshot(self, now: float | None = None) -> None:
        engine = self.engine
        sched, blocks = engine.scheduler, engine.blocks
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting)
        queued += sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)
        self._snapshot_at = time.monotonic() if now is None else now
        self.snapshot = InstanceSnapshot(
            ts=time.time(), running=len(sched.running), waiting=len(sched.waiting), queued_prompt_tokens=queued,
            kv_blocks_total=blocks.num_blocks, kv_blocks_used=blocks.num_used_blocks,
            tokens_emitted=self.encoder.tokens_emitted, steps=self._steps, pool_capacity=engine.pool.capacity_bytes,
            pool_by_owner=engine.pool.by_owner(), resident_adapters=tuple(engine.runner.lora.resident),
        )
