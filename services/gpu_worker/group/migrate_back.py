"""Migrate-back after a restore (KunServe §4.3): each owner pulls its requests' KV home.

Once a member holds every layer again (`RestoreLayers`) and its own exchange is over, its
requests' KV is still spread over the stages: the KV of another member's layers lies on that
member (the *keeper*). The owner pulls it back, per layer, in two rounds, like a live
migration's pre-copy and stop:

1. *precopy* — while the requests keep decoding through the pipeline, `KvPull` asks every
   keeper for tokens [0, n) of each running request (n: the tokens it has computed, whose KV
   never changes); each keeper answers one `KvReturn` per layer of its stage (KV priority).
2. *final* — the owner stops launching micro-batches, waits for those in flight, and pulls
   the tail [landed, n) of every request (requests admitted meanwhile from 0); the keepers
   free the requests once sent. The stall is one round trip of a few tokens' KV.

Then the owner runs *solo*: its requests run wholly local (all layers, `LLMEngine.step`),
while it still runs its stage for the other owners until they have pulled theirs back. A
request whose KV could not be landed (no block, or the keeper lacked it) is preempted:
recomputed locally, token-exact. Engine thread only; no I/O but the transport.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.gpu_worker.engine.sequence import SequenceStatus

from .wire import KvPull, KvReturn, KvSpan, spec

if TYPE_CHECKING:
    from .member import GroupMember


def write_tokens(kv_cache: object, table: list[int], start: int, data: torch.Tensor) -> None:
    """Write [2, n, kv_heads, d] as tokens [start, start + n) of one layer's block table."""
    bs = kv_cache.block_size  # type: ignore[attr-defined]
    blocks = kv_cache.blocks  # type: ignore[attr-defined]
    pos = torch.arange(start, start + data.shape[1], device=blocks.device)
    ids = torch.tensor(table, dtype=torch.long, device=blocks.device)
    slots = ids[pos // bs] * bs + pos % bs
    data = data.to(device=blocks.device, dtype=blocks.dtype)
    kv_cache.write(slots, data[0], data[1])  # type: ignore[attr-defined]


class MigrateBack:
    def __init__(self, member: "GroupMember") -> None:
        self.member = member
        self.phase = "idle"  # idle -> precopy -> draining -> final -> done
        self.pending = 0  # KvReturns still to come
        self.landed: dict[tuple[str, int], int] = {}  # (seq, layer) -> tokens [0, n) of it here

    @property
    def paused(self) -> bool:
        """No micro-batch is launched: the final round needs the requests still."""
        return self.phase in ("draining", "final")

    @property
    def active(self) -> bool:
        return self.phase in ("precopy", "draining", "final")

    def reset(self) -> None:
        """A drop again (the restore was cancelled): what was pulled is freed; start over later."""
        m = self.member
        foreign = self._foreign_layers()
        for seq_id in {s for s, _ in self.landed}:
            if m.engine.blocks.has(seq_id):
                m.engine.blocks.release_layers(seq_id, foreign)
        self.phase, self.pending, self.landed = "idle", 0, {}

    def forget(self, seq_id: str) -> None:
        """The request finished or was preempted: its KV here is gone."""
        for layer in self._foreign_layers():
            self.landed.pop((seq_id, layer), None)

    def advance(self) -> None:
        """Take the next step if its condition holds (called before each of the owner's steps)."""
        m = self.member
        if m.solo or m.group_id is None:
            return
        if self.phase == "idle":
            if not (m.restore_requested and m.restored) or m._exchange or m._awaiting:
                return
            self._pull(final=False)
            self.phase = "precopy"
        if self.phase == "precopy" and self.pending == 0:
            self.phase = "draining"
        if self.phase == "draining" and not m.in_flight:
            self._pull(final=True)
            self.phase = "final"
        if self.phase == "final" and self.pending == 0:
            self._check_complete()
            m.go_solo()
            self.phase = "done"

    # --- the owner's side -----------------------------------------------------------------
    def _foreign_layers(self) -> list[int]:
        m = self.member
        return [l for st in m.stages if st.member != m.member_id for l in st.layers]

    def _pull(self, *, final: bool) -> None:
        m = self.member
        spans = []
        for seq in m.engine.scheduler.running:
            n = seq.num_computed_tokens
            if n <= 0:
                continue
            start = 0
            if final:
                start = min((self.landed.get((seq.seq_id, l), 0) for l in self._foreign_layers()), default=n)
            if start < n:
                spans.append(KvSpan(seq_id=seq.seq_id, start=start, end=n))
        freed, m._freed = (m._freed, []) if final else ([], m._freed)
        if not spans and not freed and not final:
            return  # (the final pull always goes: it tells the keepers this owner runs alone now)
        for st in m.stages:
            if st.member == m.member_id:
                continue
            m.transport.send(st.member, KvPull(group_id=m.group_id or "", owner=m.member_id, spans=spans,
                                               final=final, freed=freed), [])
            self.pending += len(st.layers)

    def land(self, frame: KvReturn, data: torch.Tensor) -> None:
        m = self.member
        self.pending = max(0, self.pending - 1)
        offset = 0
        for e in frame.entries:
            part = data[:, offset:offset + e.end - e.start]
            offset += e.end - e.start
            seq = m.engine.scheduler.get(e.seq_id)
            have = self.landed.get((e.seq_id, frame.layer), 0)
            if seq is None or seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens < e.end \
                    or e.start > have:
                continue  # preempted or finished meanwhile (recomputed, or gone)
            if not m.engine.blocks.allocate_layers(e.seq_id, [frame.layer], e.end):
                m.preempt(e.seq_id)  # no room to hold it whole: recompute it here later
                continue
            write_tokens(m.engine.runner.kv_cache, m.engine.blocks.block_tables(e.seq_id)[frame.layer], e.start, part)
            self.landed[(e.seq_id, frame.layer)] = e.end

    def _check_complete(self) -> None:
        """Every running request must hold all its KV here now; one that does not is recomputed."""
        m = self.member
        for seq in list(m.engine.scheduler.running):
            n = seq.num_computed_tokens
            if n > 0 and any(self.landed.get((seq.seq_id, l), 0) < n for l in self._foreign_layers()):
                m.preempt(seq.seq_id)
        self.landed = {}


def serve_pull(member: "GroupMember", frame: KvPull) -> None:
    """The keeper's side: send the spans' KV of each layer of this member's stage, then (final)
    free every request of that owner held here, not only the spans': it runs them alone from now
    on and never routes through this member again, so whatever path a request took (finished or
    aborted while the owner stopped launching, migrated away, preempted) none of its KV stays."""
    m = member
    blocks, cache, cfg = m.engine.blocks, m.engine.runner.kv_cache, m.engine.runner.cfg
    for layer in m.layers:
        entries, parts = [], []
        for span in frame.spans:
            tables = blocks.block_tables(span.seq_id) if blocks.has(span.seq_id) else {}
            table = tables.get(layer, [])
            if len(table) * blocks.block_size < span.end:
                continue  # not here (the owner recomputes it)
            parts.append(cache.export_tokens(table, span.end)[:, span.start:span.end])
            entries.append(span)
        kv = torch.cat(parts, dim=1) if parts else torch.empty((2, 0, cfg.num_kv_heads, cfg.head_dim),
                                                                dtype=cache.blocks.dtype)
        m.transport.send(frame.owner, KvReturn(group_id=frame.group_id, keeper=m.member_id, layer=layer,
                                               final=frame.final, entries=entries, kv=spec(kv)), [kv], kv=True)
    if frame.final:
        for seq_id in [*(s.seq_id for s in frame.spans), *frame.freed]:
            m.executor.free(seq_id)
        m.executor.free_owner(frame.owner)
