"""One model instance: an `LLMEngine` and the dedicated thread that steps it.

The asyncio side never touches the engine. It puts commands (add, abort, stop) on a
thread-safe queue; the engine thread applies every queued command before each step (so an
abort lands within one step), steps, encodes that step's chunks (`stream.StreamEncoder`) and
hands the bytes back to the event loop in one call per step (after a step with a first token,
while few requests run, it waits until the loop has published them: TTFT). After each step it
also leaves an immutable `InstanceSnapshot` for the stats publisher to read.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from services.gpu_worker import instance_kv
from services.gpu_worker.engine.engine import DetachedRequest, LLMEngine
from services.gpu_worker.engine.outputs import RequestOutput
from services.gpu_worker.engine.sampling_params import SamplingParamsError
from services.gpu_worker.engine_params import engine_params
from services.gpu_worker.group.member import GroupMember
from services.gpu_worker.instance_kv import KvSnapshot, Stopped
from services.gpu_worker.instance_snapshot import InstanceSnapshot, take_snapshot
from services.gpu_worker.stream import Payload, StreamEncoder
from shared.events import Assignment
from shared.logging import get_logger

log = get_logger("tidal.gpu_worker.instance")


class Emit(Protocol):
    """Called on the engine thread with one step's payloads and the ids of requests that ended;
    `sent`, when given, is set once the event loop has published them."""

    def __call__(self, payloads: list[Payload], ended: list[str], sent: threading.Event | None = None) -> None: ...


Crashed = Callable[[str, BaseException], None]
SNAPSHOT_EVERY_S = 0.02  # at most this stale while busy (fresh whenever the engine goes idle)
GIL_SWITCH_S = 0.0002  # how long the event loop may wait for the GIL while the engine thread runs
HANDOFF_MAX_RUNNING = 4  # up to this many running requests, a first token's publish is awaited
HANDOFF_WAIT_S = 0.002  # ... at most this long
PICKUP_WAIT_S = 0.001  # how long an assignment to an idle engine waits for the engine thread to take it
STALLED_WAIT_S = 0.002  # a step that scheduled nothing (waiting for KV another instance holds): pause, don't spin


class ModelInstance:
    def __init__(self, instance_id: str, model: str, engine: LLMEngine, worker_id: str, *,
                 stream_interval_s: float = 0.0, min_step_s: float = 0.0) -> None:
        self.instance_id = instance_id
        self.min_step_s = min_step_s  # `[[workers]] min_step_time`: a step's floor (0: none)
        self.model = model
        self.engine = engine
        self.encoder = StreamEncoder(worker_id, stream_interval_s)  # coalesces each request's tokens
        self.num_layers = engine.runner.cfg.num_layers
        self.block_bytes = engine.blocks.block_bytes
        self.adapters = frozenset(engine.runner.lora.host)  # registered (host) adapters
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.runner.cfg.vocab_size
        self.accepting = True  # False once EvictModel stops its admissions (services/gpu_worker/model_ctl.py)
        self.snapshot = InstanceSnapshot()
        self.group: GroupMember | None = None  # set on the engine thread by JoinGroup (group_ctl.py)
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._next: tuple[str, object] | None = None  # a command `_stall` took off the inbox
        self._idle = False  # the engine thread sleeps on the inbox
        self._picked = threading.Event()  # set when it woke up with a command
        self._thread: threading.Thread | None = None
        self._emit: Emit | None = None
        self._crashed: Crashed | None = None
        self._steps = 0
        self._snapshot_at = 0.0
        # Another instance on the shared pool may take this one's free KV blocks (on its own
        # thread): an idle engine thread is woken to refresh its snapshot, else its stats go stale.
        retire = engine.blocks.on_retire

        def retired(ids: list[int]) -> None:
            if retire is not None:
                retire(ids)
            if self._idle or self._thread is None:
                self._inbox.put(("poke", None))

        engine.blocks.on_retire = retired
        self._take_snapshot()

    # --- asyncio side (thread-safe) ---------------------------------------------------------
    def start(self, emit: Emit, crashed: Crashed) -> None:
        """Start the engine thread; `emit` gets each step's payloads, `crashed` an engine failure."""
        self._emit, self._crashed = emit, crashed
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.instance_id}", daemon=True)
        self._thread.start()

    def submit(self, assignment: Assignment) -> None:
        idle = self._idle
        if idle:
            self._picked.clear()
        self._inbox.put(("add", assignment))
        if idle:
            # The woken engine thread needs the GIL, which this (event loop) thread would hold for
            # its reply and the rest of the loop turn (up to the 0.2 ms switch interval): a new
            # request's TTFT. Wait here, GIL released, until the engine thread has the command.
            self._picked.wait(PICKUP_WAIT_S)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def detach(self, request_id: str) -> "asyncio.Future[tuple[list[int], int] | None]":
        """Take a request out between two steps WITHOUT ending its stream (migration): resolves
        to (its output tokens so far, its stream's next seq), or None if it already ended."""
        fut: concurrent.futures.Future[tuple[list[int], int] | None] = concurrent.futures.Future()
        self._inbox.put(("detach", (request_id, fut)))
        return asyncio.wrap_future(fut)

    def run_on_engine(self, fn: Callable[[LLMEngine], object]) -> "asyncio.Future[object]":
        """Run `fn(engine)` on the engine thread between two steps (e.g. register or remove a LoRA
        adapter); resolves to its result, or raises what it raised."""
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return asyncio.wrap_future(fut)

    # --- live KV migration (services/gpu_worker/migration_kv.py): each is one engine-thread call --
    def kv_snapshot(self, request_id: str, first_block: int) -> "asyncio.Future[KvSnapshot | None]":
        """The request's progress and views of its full blocks from `first_block` (instance_kv.snapshot)."""
        return self.run_on_engine(  # type: ignore[return-value]
            lambda engine: instance_kv.snapshot(engine, self.encoder, request_id, first_block))

    def stop_for_handover(self, request_id: str, sent_blocks: int, preemptions: int) -> "asyncio.Future[Stopped | None]":
        """The final stop, the request's KV blocks kept (instance_kv.stop_for_handover); None if it ended."""
        return self.run_on_engine(lambda engine: instance_kv.stop_for_handover(  # type: ignore[return-value]
            engine, self.encoder, self._flush, request_id, sent_blocks, preemptions))

    def resume_detached(self, detached: DetachedRequest, next_seq: int,
                        epoch: tuple[int, int]) -> "asyncio.Future[None]":
        """Run a request stopped by `stop_for_handover` here again, on its held blocks (a failed move),
        as assignment `epoch` (attempt, handover)."""
        return self.run_on_engine(  # type: ignore[return-value]
            lambda engine: instance_kv.resume_detached(engine, self.encoder, detached, next_seq, epoch))

    def reserve_kv(self, request_id: str, num_tokens: int, expected_tokens: int, first_block: int,
                   last_block: int) -> "asyncio.Future[list[object] | None]":
        """Destination: hold blocks for `num_tokens` and views of [first_block, last_block) to receive
        into (instance_kv.reserve); None if there is no room."""
        return self.run_on_engine(lambda engine: instance_kv.reserve(  # type: ignore[return-value]
            engine, request_id, num_tokens, expected_tokens, first_block, last_block))

    def release_kv(self, request_id: str) -> "asyncio.Future[int]":
        """Free the blocks held/reserved under `request_id` (never a running request's)."""
        return self.run_on_engine(lambda engine: engine.release_kv(request_id))  # type: ignore[return-value]

    def attach(self, a: Assignment) -> "asyncio.Future[None]":
        """Destination's commit: admit `a` on the blocks reserved for it (instance_kv.attach). Raises
        ValueError/SamplingParamsError (nothing changed) if it cannot."""
        return self.run_on_engine(  # type: ignore[return-value]
            lambda engine: instance_kv.attach(engine, self.encoder, a))

    def deliver_group_frame(self, frame: object, tensors: list[object]) -> None:
        """A buddy-group frame for this member, handled on the engine thread between steps."""
        self._inbox.put(("group", (frame, tensors)))

    def _has_work(self) -> bool:
        if self.group is not None and (self.group.busy or self.group.exchanging):
            return True
        return self.engine.has_unfinished

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
        # The event loop thread publishes this thread's chunks and answers assignments; with the
        # default 5 ms switch interval it can wait that long for the GIL while a step runs Python.
        sys.setswitchinterval(GIL_SWITCH_S)
        # The loaded model, tokenizer and libraries are millions of long-lived objects: a full
        # collection scanning them stalls every thread of the worker for 100-200 ms mid-stream.
        gc.freeze()
        try:
            while True:
                payloads: list[Payload] = []
                ended: list[str] = []
                if self.engine.stalled:  # nothing could run: give the other instances the core and the GIL
                    self._stall()
                if not self._apply(block=not self._has_work(), payloads=payloads, ended=ended):
                    return
                outputs = self._step()
                now = time.monotonic()
                firsts = self.encoder.encode_outputs(outputs, now, payloads, ended) if outputs is not None else 0
                if payloads or ended:  # first: the snapshot can wait, the tokens should not
                    assert self._emit is not None
                    if firsts and len(self.engine.scheduler.running) <= HANDOFF_MAX_RUNNING:
                        # A first token (TTFT): let the event loop publish it before the next step
                        # competes with it for the GIL and a core; cheap while few requests run.
                        sent = threading.Event()
                        self._emit(payloads, ended, sent)
                        sent.wait(HANDOFF_WAIT_S)
                    else:
                        self._emit(payloads, ended)
                if ended or now - self._snapshot_at >= SNAPSHOT_EVERY_S or not self.engine.has_unfinished:
                    self._take_snapshot(now)
        except Exception as exc:  # the engine's state is unknown now: the worker must go
            log.exception("engine thread crashed", instance=self.instance_id)
            if self._crashed is not None:
                self._crashed(self.instance_id, exc)

    def _step(self) -> list[RequestOutput] | None:
        """One step: the buddy group's if this instance is a member (services/gpu_worker/group/),
        else the engine's; None when there is nothing to step. It lasts at least `min_step_s`."""
        started = time.monotonic()
        if self.group is not None:
            outputs = self.group.step()
            if self.group is not None:  # (a collapse may have ended the group in the step)
                self.group.pump_exchange(1, time.monotonic())
        elif self.engine.has_unfinished:
            outputs = self.engine.step()
        else:
            return None
        if self.min_step_s > 0:  # the rest of the floor; commands queued meanwhile apply before the next step
            time.sleep(max(0.0, started + self.min_step_s - time.monotonic()))
        self._steps += 1
        return outputs

    def _stall(self) -> None:
        """Wait a moment for a command (kept for `_apply`, first) instead of spinning on empty steps."""
        try:
            self._next = self._inbox.get(timeout=STALLED_WAIT_S)
        except queue.Empty:
            pass

    def _apply(self, *, block: bool, payloads: list[Payload], ended: list[str]) -> bool:
        """Apply queued commands (waiting for one when idle); False on stop."""
        while True:
            try:
                if self._next is not None:  # taken by _stall
                    (kind, arg), self._next = self._next, None
                elif block:
                    self._idle = True
                    try:
                        kind, arg = self._inbox.get(timeout=1.0)
                    finally:
                        self._idle = False
                    self._picked.set()
                else:
                    kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "poke":
                pass  # only wakes the thread: the snapshot is taken after the commands
            elif kind == "abort":
                self.engine.abort(str(arg))  # its final "abort" output comes with the next step
            elif kind == "call":
                fn, done = arg  # type: ignore[misc]
                try:
                    done.set_result(fn(self.engine))
                except Exception as exc:  # the caller's to handle; the engine thread goes on
                    done.set_exception(exc)
            elif kind == "detach":
                self._detach(*arg)  # type: ignore[misc]
            elif kind == "group":  # a frame from another member of this instance's buddy group
                if self.group is not None:
                    outputs = self.group.handle(*arg)  # type: ignore[misc]
                    self.encoder.encode_outputs(outputs, time.monotonic(), payloads, ended)
            elif kind == "add":
                self._add(arg, payloads, ended)  # type: ignore[arg-type]

    def _detach(self, request_id: str, fut: "concurrent.futures.Future[tuple[list[int], int] | None]") -> None:
        # an aborted request is out of the engine but keeps its stream until its final output
        state = self.engine.detach(request_id, keep_kv=False) if request_id in self.encoder.streams else None
        if state is None:
            fut.set_result(None)
            return
        detached = self.encoder.detach(request_id)  # no final chunk: the stream goes on elsewhere
        assert detached is not None
        flushed, next_seq = detached
        if flushed is not None:  # its coalesced tokens go out before anyone continues the stream
            self._flush(flushed)
        fut.set_result((state.output_token_ids, next_seq))

    def _flush(self, payload: Payload) -> None:
        """Publish a detached request's coalesced tokens now (it has no final chunk here)."""
        assert self._emit is not None
        self._emit([payload], [])

    def _add(self, a: Assignment, payloads: list[Payload], ended: list[str]) -> None:
        try:
            params = engine_params(a.sampling)
            self.encoder.open(a.request_id, a.next_seq, params.logprobs is not None, (a.attempt, a.handover))
            self.engine.add_request(
                a.request_id, list(a.prompt_token_ids), params, adapter=a.adapter, priority=-a.priority,
                resume_token_ids=list(a.resume_token_ids) or None,
            )
        except (ValueError, SamplingParamsError) as exc:  # validated before acceptance; a last guard
            log.warning("engine refused an accepted request", request_id=a.request_id, error=str(exc))
            payloads.append(self.encoder.error(a.request_id, str(exc), a.next_seq, (a.attempt, a.handover)))
            ended.append(a.request_id)

    def _take_snapshot(self, now: float | None = None) -> None:
        self._snapshot_at = time.monotonic() if now is None else now
        self.snapshot = take_snapshot(self.engine, tokens_emitted=self.encoder.tokens_emitted, steps=self._steps)


__all__ = ["Crashed", "Emit", "ModelInstance", "engine_params"]
