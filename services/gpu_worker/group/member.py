"""A worker's engine as one member of a buddy group (KunServe §4.1–§4.2). No I/O.

Every member *owns* the requests admitted to it (scheduler, sampler, detokenizer stay
there) and runs its kept layer range for everyone's micro-batches. A micro-batch goes
through the stages in layer order, one activation hop per stage: the owner schedules it,
the members run their stages (`StagePass` carries the hidden states on), the last stage
returns the logits (`StageDone`) and the owner samples. While one is in flight the owner
schedules the next from its other sequences, up to `max_micro_batches`, so every stage
has work.

`join` forms the group: the member drops the layers it does not keep (their bytes are KV
blocks at its next schedule) but keeps its running requests' KV of those layers (they are
the *victims*). Victims keep decoding: the member that keeps such a layer runs its
attention on the owner (remote attention, `stage_executor`) while `pump_exchange` sends the
layer's KV over (`KvExchange`, KV priority, a layer per call); when it has landed there the
attention is local and the owner frees its copy (`KvLanded`).

The transport delivers frames to `handle` and serves `serve_attention` synchronously; it
must call everything of one member from one thread (the engine's), except
`serve_attention`, which touches only the victims' KV of dropped layers.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import msgspec
import torch

from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.engine.outputs import RequestOutput
from services.gpu_worker.engine.sampler import SampleResult

from .engine_step import complete_micro_batch, schedule_excluding
from .member_lifecycle import MemberLifecycle
from .migrate_back import MigrateBack, serve_pull
from .stage_executor import AttentionHolder, KvShort, StageExecutor
from .wire import (
    AttnCall, Frame, KvEntry, KvExchange, KvLanded, KvPull, KvReturn, StageChunk, StageDone, StageFree, StagePass,
    spec,
)

EXCHANGE_RETRY_S = 1.0  # a layer's KvExchange not answered (KvLanded) this long after sending is sent again
EXCHANGE_ATTEMPTS = 3  # ... this many times; then its victims fall back to re-prefill (recompute)


class PeerLost(RuntimeError):
    """A member this one needs (remote attention, a stage) is gone or its link failed."""


@dataclass(frozen=True, slots=True)
class Stage:
    member: str
    layers: range


class Transport(Protocol):
    def send(self, peer: str, frame: Frame, tensors: list[torch.Tensor], *, kv: bool = False) -> None:
        """Queue a frame for `peer` (activation priority; `kv`: KV priority). Never blocks."""

    def call_attention(self, peer: str, call: AttnCall, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Remote attention on `peer`; blocks until its output is back."""


def validate_stages(stages: list[Stage], num_layers: int) -> None:
    """The stages must tile [0, num_layers) in order, one per member."""
    expect = 0
    for st in stages:
        if st.layers.start != expect or st.layers.stop <= st.layers.start or st.layers.step != 1:
            raise ValueError(f"stage layers must tile [0, {num_layers}) in order: got "
                             f"{[(s.member, s.layers.start, s.layers.stop) for s in stages]}")
        expect = st.layers.stop
    if expect != num_layers:
        raise ValueError(f"stages cover layers [0, {expect}), the model has {num_layers}")
    members = [s.member for s in stages]
    if len(set(members)) != len(members):
        raise ValueError(f"a member may hold one stage only: {members}")


class GroupMember(MemberLifecycle):
    def __init__(self, engine: LLMEngine, member_id: str, transport: Transport, *, max_micro_batches: int = 2) -> None:
        self.engine, self.member_id, self.transport = engine, member_id, transport
        self.max_micro_batches = max_micro_batches
        self.group_id: str | None = None
        self.stages: list[Stage] = []
        self.layers = engine.runner.stage  # the layers of this member's stage
        self.executor = StageExecutor(member_id, engine.runner, engine.blocks, self._remote_attention)
        self.holder = AttentionHolder(engine.runner, engine.blocks)
        self.victims: dict[str, int] = {}  # own running requests at the drop -> tokens whose KV stayed here
        self.in_flight: dict[int, tuple[list[str], object]] = {}  # micro id -> (seq ids, SchedulerOutput)
        self._in_flight_ids: set[str] = set()
        self._freed: list[str] = []
        self._exchange: list[tuple[int, str]] = []  # (layer, member that keeps it) still to send
        self._awaiting: dict[int, list] = {}  # layer exchanged -> [keeper, sent at, attempts, seqs] until KvLanded
        self._attempts: dict[int, int] = {}  # layer to send again -> attempts so far
        self._preempt_later: set[str] = set()  # to preempt once their micro-batch is back
        self._micro = itertools.count()
        self._calls = itertools.count()
        self.hops = 0  # activation messages sent for micro-batches (passes and results)
        self.solo = False  # restored and migrated back: own requests run on every layer here
        self.restore_requested = False  # RestoreLayers came (a DropLayers clears it): migrate back once restored
        self.back = MigrateBack(self)
        self.fallbacks = 0  # victims recomputed because their KV exchange kept failing
        # Set (on the event loop) once a collapse is decided: the member admits nothing new until the
        # engine thread has run it, so a request is never admitted into a pipeline that is going away.
        self.collapsing = False

    # --- forming the group ----------------------------------------------------------------
    def join(self, group_id: str, stages: list[Stage], *, drop: bool = True) -> int:
        """Become a member running `stages`' stage of this member; with `drop`, drop the layers
        other members keep at once (else `drop_layers` later). Returns the bytes freed."""
        if self.group_id is not None:
            raise ValueError(f"{self.member_id} is already in group {self.group_id}")
        runner = self.engine.runner
        validate_stages(stages, runner.cfg.num_layers)
        mine = next((s for s in stages if s.member == self.member_id), None)
        if mine is None:
            raise ValueError(f"{self.member_id} is not a member of group {group_id}")
        held = runner.stage
        if not (held.start <= mine.layers.start and mine.layers.stop <= held.stop):
            raise ValueError(f"{self.member_id} holds layers {held}, cannot keep {mine.layers}")
        self.group_id, self.stages, self.layers = group_id, list(stages), mine.layers
        self.executor.layers = mine.layers
        self.victims = {s.seq_id: s.num_computed_tokens for s in self.engine.scheduler.running
                        if s.num_computed_tokens > 0}
        keeper = {l: st.member for st in stages for l in st.layers}
        self._exchange = [(l, keeper[l]) for l in held if l not in mine.layers] if self.victims else []
        self.engine.blocks.set_layers(mine.layers, keep_tables=True)
        runner.set_kv_layers(mine.layers)
        return self.drop_layers(held.start, held.stop) if drop else 0

    def drop_layers(self, start: int, end: int) -> int:
        """Free the weights of layers in [start, end) outside this member's stage; returns the bytes."""
        if self.group_id is None:
            raise ValueError(f"{self.member_id} is in no group: only a member drops layers")
        if self.solo or self.back.paused:
            raise RuntimeError(f"{self.member_id} has migrated its requests back (restore): it cannot drop again")
        if self.back.active:
            self.back.reset()  # a cancelled restore: the pulled KV goes, the pipeline goes on
        self.restore_requested = False
        freed = 0
        if start < self.layers.start:
            freed += self.engine.drop_layers(start, min(end, self.layers.start))
        if end > self.layers.stop:
            freed += self.engine.drop_layers(max(start, self.layers.stop), end)
        return freed

    def preempt(self, seq_id: str) -> None:
        """Recompute `seq_id` from its tokens (token-exact): its KV is dropped on every member. One
        in a micro-batch in flight is preempted once that is back (the stages still read its KV)."""
        if seq_id in self._in_flight_ids:
            self._preempt_later.add(seq_id)
            return
        self._preempt_later.discard(seq_id)
        self.victims.pop(seq_id, None)
        self.back.forget(seq_id)
        self.engine.scheduler.preempt(seq_id)

    @property
    def busy(self) -> bool:
        """Requests to run, micro-batches out, or frees the other members have not heard of yet."""
        return bool(self.in_flight or self.engine.has_unfinished or self._freed or self.engine.scheduler._finished_ids
                    or self.back.active or (self.restore_requested and not self.solo and self.back.phase == "idle"))

    @property
    def exchanging(self) -> bool:
        return bool(self._exchange or self._awaiting)

    def pump_exchange(self, layers: int = 1, now: float = 0.0) -> int:
        """Send the next `layers` dropped layers' victim KV to their keepers; returns bytes queued.
        A layer not landed `EXCHANGE_RETRY_S` after it was sent (a lost or corrupt transfer) is sent
        again; after `EXCHANGE_ATTEMPTS` its victims fall back to re-prefill (preempted: recomputed)."""
        for layer, entry in list(self._awaiting.items()):
            keeper, at, attempts, _sent = entry
            if now - at < EXCHANGE_RETRY_S:
                continue
            del self._awaiting[layer]
            if attempts >= EXCHANGE_ATTEMPTS:
                for seq_id in [s for s in self.victims if self.engine.blocks.has(s)
                               and self.engine.blocks.block_tables(s).get(layer)]:
                    self.fallbacks += 1
                    self.preempt(seq_id)
            else:
                self._exchange.insert(0, (layer, keeper))
                self._attempts[layer] = attempts
        sent = 0
        for _ in range(min(layers, len(self._exchange))):
            layer, keeper = self._exchange.pop(0)
            attempts = self._attempts.pop(layer, 0) + 1
            entries, parts = [], []
            for seq_id, n in self.victims.items():
                tables = self.engine.blocks.block_tables(seq_id) if self.engine.blocks.has(seq_id) else {}
                if self.engine.scheduler.get(seq_id) is None or not tables.get(layer):
                    continue  # finished or preempted since the drop
                parts.append(self.engine.runner.kv_cache.export_tokens(tables[layer], n))
                entries.append(KvEntry(seq_id=seq_id, num_tokens=n))
            if not entries:
                self._awaiting.pop(layer, None)
                continue
            self._awaiting[layer] = [keeper, now, attempts, [e.seq_id for e in entries]]
            kv = torch.cat(parts, dim=1)
            self.transport.send(keeper, KvExchange(group_id=self.group_id or "", owner=self.member_id, layer=layer,
                                                   entries=entries, kv=spec(kv)), [kv], kv=True)
            sent += kv.numel() * kv.element_size()
        return sent

    # --- the owner's side -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch a new micro-batch if a slot is free and a sequence is ready; returns outputs
        finished here (the local last stage, aborts)."""
        if self.group_id is None:
            raise RuntimeError(f"{self.member_id} is not in a group: drive the engine's own step")
        self.back.advance()
        if self.solo:  # own requests run on every layer here; frames of the others come via `handle`
            self.engine.stalled = not self.engine.has_unfinished
            return self.engine.step() if self.engine.has_unfinished else []
        for seq_id in [s for s in self._preempt_later if s not in self._in_flight_ids]:
            self.preempt(seq_id)
        if self.back.paused or len(self.in_flight) >= self.max_micro_batches:
            self.engine.stalled = True  # nothing to launch until a micro-batch returns
            return []
        out = schedule_excluding(self.engine, self._in_flight_ids)
        for seq_id in (*out.finished, *out.preempted):
            self.victims.pop(seq_id, None)
            self.back.forget(seq_id)
        self._freed += out.finished + out.preempted
        if out.is_empty:
            self.engine.stalled = True  # wait for a frame or a command instead of spinning
            if self._freed:  # no micro-batch will carry it: tell the other members now
                for st in self.stages:
                    if st.member != self.member_id:
                        self.transport.send(st.member, StageFree(group_id=self.group_id, owner=self.member_id,
                                                                 seq_ids=self._freed), [])
                self._freed = []
            return self.engine._postprocess([], SampleResult([])) if self.engine._pending else []
        micro = next(self._micro)
        ids = [c.seq_id for c in out.chunks]
        self.in_flight[micro] = (ids, out)
        self._in_flight_ids.update(ids)
        chunks = [StageChunk(seq_id=c.seq_id, start_pos=c.start_pos, token_ids=list(c.token_ids), sample=c.sample,
                             adapter=c.adapter, kv_at_owner=self.victims.get(c.seq_id, 0)) for c in out.chunks]
        header = StagePass(group_id=self.group_id, owner=self.member_id, micro_id=micro, stage=0, chunks=chunks,
                           freed=self._freed)
        self._freed = []
        return self._route(header, None)

    def _refused(self, micro: int, short: list[str]) -> list[RequestOutput]:
        """A stage had no KV blocks for `short`: nothing of the micro-batch ran. Those are preempted
        (their KV freed on every member, recomputed later), the others are scheduled again."""
        entry = self.in_flight.pop(micro, None)
        if entry is not None:
            self._in_flight_ids.difference_update(entry[0])
        for seq_id in short:
            if self.engine.scheduler.get(seq_id) is not None:
                self.preempt(seq_id)
        return []

    def _complete(self, micro: int, logits: torch.Tensor | None, seq_ids: list[str]) -> list[RequestOutput]:
        if micro not in self.in_flight:
            return []  # abandoned (a lost member): its sequences were rescheduled
        ids, out = self.in_flight.pop(micro)
        self._in_flight_ids.difference_update(ids)
        outputs = complete_micro_batch(self.engine, out, logits, seq_ids)  # type: ignore[arg-type]
        for o in outputs:
            if o.finished:
                self.victims.pop(o.request_id, None)
        return outputs

    # --- every member's side ----------------------------------------------------------------
    def _route(self, header: StagePass, hidden: torch.Tensor | None) -> list[RequestOutput]:
        while True:
            stage = self.stages[header.stage]
            if stage.member != self.member_id:
                self.hops += 1
                header = msgspec.structs.replace(header, hidden=spec(hidden) if hidden is not None else None)
                self.transport.send(stage.member, header, [hidden] if hidden is not None else [])
                return []
            try:
                result = self.executor.run(header, hidden)
            except KvShort as short:
                if header.owner == self.member_id:
                    return self._refused(header.micro_id, short.seq_ids)
                self.transport.send(header.owner, StageDone(group_id=header.group_id, micro_id=header.micro_id,
                                                            seq_ids=[], short=short.seq_ids), [])
                return []
            except PeerLost:  # the pass is lost; the collapse (the member's death noticed) follows
                if header.owner == self.member_id:
                    self._refused(header.micro_id, [])
                return []
            if header.owner == self.member_id:  # aborted while in flight: not kept past this pass
                for c in header.chunks:
                    if self.engine.scheduler.get(c.seq_id) is None:
                        self.engine.blocks.free(c.seq_id)
            if header.stage + 1 < len(self.stages):
                header = msgspec.structs.replace(header, stage=header.stage + 1, freed=header.freed)
                hidden = result.hidden
                continue
            if header.owner == self.member_id:
                return self._complete(header.micro_id, result.logits, result.sampled_seq_ids)
            self.hops += 1
            logits = result.logits
            self.transport.send(header.owner, StageDone(group_id=header.group_id, micro_id=header.micro_id,
                                                        seq_ids=result.sampled_seq_ids,
                                                        logits=spec(logits) if logits is not None else None),
                                [logits] if logits is not None else [])
            return []

    def _local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors off the wire (host memory) on this member's device (no copy where they are already)."""
        device = self.engine.runner.device
        return [t.to(device) for t in tensors]

    def handle(self, frame: Frame, tensors: list[torch.Tensor]) -> list[RequestOutput]:
        """A frame from another member (on the engine thread)."""
        tensors = self._local(tensors)  # hidden states, logits (sampled here: same device as unsplit), KV
        if isinstance(frame, StagePass):
            return self._route(frame, tensors[0] if frame.hidden is not None else None)
        if isinstance(frame, StageFree):
            for seq_id in frame.seq_ids:
                self.executor.free(seq_id)
            return []
        if isinstance(frame, StageDone):
            if frame.short:
                return self._refused(frame.micro_id, frame.short)
            return self._complete(frame.micro_id, tensors[0] if frame.logits is not None else None, frame.seq_ids)
        if isinstance(frame, KvExchange):
            landed, offset = [], 0
            for e in frame.entries:
                if self.executor.import_kv(e.seq_id, frame.layer, tensors[0][:, offset:offset + e.num_tokens],
                                           frame.owner):
                    landed.append(e.seq_id)
                offset += e.num_tokens
            # answered even if nothing landed: the owner stops waiting (and resends or falls back)
            self.transport.send(frame.owner, KvLanded(group_id=frame.group_id, layer=frame.layer, seq_ids=landed), [])
            return []
        if isinstance(frame, KvPull):
            serve_pull(self, frame)
            return []
        if isinstance(frame, KvReturn):
            self.back.land(frame, tensors[0])
            return []
        if isinstance(frame, KvLanded):
            entry = self._awaiting.pop(frame.layer, None)
            for seq_id in set(entry[3] if entry else ()) - set(frame.seq_ids):
                if seq_id in self.victims:  # the keeper had no room for it: re-prefill instead
                    self.fallbacks += 1
                    self.preempt(seq_id)
            for seq_id in frame.seq_ids:  # no more remote attention for it: free our copy
                if self.engine.scheduler.get(seq_id) is not None and self.engine.blocks.has(seq_id):
                    self.engine.blocks.release_layers(seq_id, [frame.layer])
            return []
        raise ValueError(f"{self.member_id}: unexpected {type(frame).__name__} on the group channel")

    def serve_attention(self, call: AttnCall, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.holder.serve(call, *self._local(tensors))

    def _remote_attention(self, owner: str, layer: int, chunks: list[StageChunk], q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        call = AttnCall(group_id=self.group_id or "", caller=self.member_id, call_id=next(self._calls), layer=layer,
                        chunks=[msgspec.structs.replace(c, token_ids=[]) for c in chunks],
                        num_tokens=[len(c.token_ids) for c in chunks], q=spec(q), k=spec(k), v=spec(v))
        return self.transport.call_attention(owner, call, [q, k, v]).to(q.device)  # the reply is off the wire
