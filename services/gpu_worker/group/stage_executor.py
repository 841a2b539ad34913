"""One member's share of a buddy group's micro-batches: its layers, its KV, remote attention.

`StageExecutor.run` executes stage `i` of a micro-batch on this member's runner with this
member's block tables (allocated here on first sight of a sequence, freed when the owner
says it finished or was preempted). A *victim* — a request that was decoding when the
group formed — arrives with `kv_at_owner` = the tokens whose KV for the layers this member
now runs still lies on its owner: until a layer's KV has been exchanged here, that layer's
attention for the victim runs on the owner (`SplitAttention` → the transport's
`call_attention`), while the new tokens' k/v are written here too (dual write), so the
exchange only has to move the KV that existed at the drop, which never changes.

`AttentionHolder` is the other side: the owner running attention over the KV it kept for
layers whose weights it dropped (no parameters needed), growing those tables as tokens come.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from services.gpu_worker.engine.attention import PagedAttention
from services.gpu_worker.engine.batch import ScheduledChunk, SchedulerOutput
from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.model_runner import ModelRunner, StepOutput

from .wire import AttnCall, StageChunk, StagePass

# (owner, layer, chunks of the remote rows, q, k, v) -> attention output of those rows
RemoteCall = Callable[[str, int, list[StageChunk], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TOMBSTONES = 10_000  # freed sequences remembered, so a late KV exchange for one is dropped


class KvShort(MemoryError):
    """This stage has no KV blocks for some sequences of a micro-batch (another owner admitted
    them by its own blocks): nothing of the pass ran."""

    def __init__(self, seq_ids: list[str]) -> None:
        super().__init__(f"no KV blocks for {seq_ids}")
        self.seq_ids = seq_ids


class SplitAttention:
    """Local paged attention for every row (writing k/v here), then the rows of victims whose
    KV for the layer is still on the owner replaced by the owner's remote attention."""

    def __init__(self, local: PagedAttention, owner: str, remote: dict[int, list[int]],
                 chunks: list[StageChunk], call: RemoteCall) -> None:
        self.local, self.owner, self.call = local, owner, call
        self.remote = remote  # layer -> indices of chunks whose attention runs on the owner
        self.chunks = chunks
        starts, row = [], 0
        for c in chunks:
            starts.append(row)
            row += len(c.token_ids)
        self._starts = starts
        self.calls = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.local(layer, q, k, v)
        idx = self.remote.get(layer)
        if not idx:
            return out
        rows = torch.cat([torch.arange(self._starts[i], self._starts[i] + len(self.chunks[i].token_ids), device=q.device)
                          for i in idx])
        try:
            out[rows] = self.call(self.owner, layer, [self.chunks[i] for i in idx], q[rows], k[rows], v[rows])
        except RuntimeError as exc:  # the owner no longer holds that KV: those requests are recomputed
            if type(exc).__name__ == "PeerLost":
                raise
            raise KvShort([self.chunks[i].seq_id for i in idx]) from exc
        self.calls += 1
        return out


class StageExecutor:
    def __init__(self, member_id: str, runner: ModelRunner, blocks: BlockManager, call: RemoteCall) -> None:
        self.member_id, self.runner, self.blocks, self.call = member_id, runner, blocks, call
        self.layers = runner.stage  # this member's stage (set by the group; may be less than what is resident)
        self.victims: dict[str, set[int]] = {}  # seq -> layers of this stage whose KV is still on its owner
        self.imported: dict[str, set[int]] = {}  # seq -> layers whose exchanged KV landed here
        self.tombstones: OrderedDict[str, None] = OrderedDict()
        self.remote_calls = 0
        self.held: set[str] = set()  # sequences with blocks of this stage here (every owner's)
        self.owner_of: dict[str, str] = {}  # another owner's sequence held here -> that owner
        self.stage_only = False  # set once this member runs its own requests on every layer (solo)

    def _allocate(self, seq_id: str, end: int) -> bool:
        """Blocks of this stage's layers covering `end` tokens of `seq_id` (all or nothing)."""
        self.held.add(seq_id)
        if not self.stage_only:
            return self.blocks.allocate(seq_id, end)
        if not self.blocks.has(seq_id):
            self.blocks.allocate(seq_id, 0)  # an empty entry; only the stage's tables grow below
        return self.blocks.allocate_layers(seq_id, self.layers, end)

    def free(self, seq_id: str) -> None:
        self.blocks.free(seq_id)
        self.held.discard(seq_id)
        self.owner_of.pop(seq_id, None)
        self.victims.pop(seq_id, None)
        self.imported.pop(seq_id, None)
        self.tombstones[seq_id] = None
        if len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def free_owner(self, owner: str) -> list[str]:
        """Free every sequence of `owner` held here (it runs them alone now, or it is gone): whatever
        path its requests took (finished, aborted, migrated, preempted), no KV of its stays here."""
        gone = [s for s, o in self.owner_of.items() if o == owner]
        for seq_id in gone:
            self.free(seq_id)
        return gone

    def run(self, header: StagePass, hidden: torch.Tensor | None) -> StepOutput:
        if header.owner != self.member_id:  # the owner's own scheduler frees its own sequences
            for seq_id in header.freed:
                self.free(seq_id)
            for c in header.chunks:
                self.owner_of[c.seq_id] = header.owner
        stage = self.layers
        chunks: list[ScheduledChunk] = []
        remote: dict[int, list[int]] = {}
        short = [c.seq_id for c in header.chunks if not self._allocate(c.seq_id, c.start_pos + len(c.token_ids))]
        if short:  # nothing runs: the owner preempts these (recomputed later) and retries the rest
            raise KvShort(short)
        for i, c in enumerate(header.chunks):
            self.tombstones.pop(c.seq_id, None)
            if c.kv_at_owner and c.seq_id not in self.victims:
                self.victims[c.seq_id] = set(stage) - self.imported.get(c.seq_id, set())
            for layer in self.victims.get(c.seq_id, ()):
                remote.setdefault(layer, []).append(i)
            chunks.append(ScheduledChunk(c.seq_id, c.token_ids, c.start_pos, self.blocks.block_tables(c.seq_id),
                                         c.adapter, c.sample))
        if remote:
            split = SplitAttention(self.runner.attention, header.owner, remote, header.chunks, self.call)
            for layer in remote:
                self.runner.set_attention(layer, split)
        if self.stage_only:  # the runner stores every layer's KV for its own requests: ours is the stage's
            self.runner.set_kv_layers(stage)
        try:
            return self.runner.execute(SchedulerOutput(chunks), hidden, layers=stage)
        finally:
            if self.stage_only:
                self.runner.set_kv_layers(self.blocks.layers)
            if remote:
                self.remote_calls += split.calls
                for layer in remote:
                    self.runner.set_attention(layer, None)

    def import_kv(self, seq_id: str, layer: int, data: torch.Tensor, owner: str = "") -> bool:
        """A victim's exchanged KV of `layer` (tokens [0, n)) from `owner` lands here; from now on
        that layer's attention for it is local. False: the sequence is gone (nothing kept)."""
        if seq_id in self.tombstones:
            return False
        if owner and owner != self.member_id:
            self.owner_of[seq_id] = owner
        n = data.shape[1]
        if not self._allocate(seq_id, n):
            return False  # no room: the owner keeps it (remote attention), retries, or recomputes it
        self.runner.kv_cache.import_tokens(self.blocks.block_tables(seq_id)[layer], data)
        self.imported.setdefault(seq_id, set()).add(layer)
        pending = self.victims.get(seq_id)
        if pending is not None:
            pending.discard(layer)
        return True


class AttentionHolder:
    """Remote attention on the owner: the KV of layers it dropped, kept for its victims."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager) -> None:
        self.runner, self.blocks = runner, blocks
        self._attention: dict[int, PagedAttention] = {}
        self.served = 0

    def serve(self, call: AttnCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = call.layer
        att = self._attention.get(layer)
        if att is None:
            att = self._attention[layer] = PagedAttention(self.runner.kv_cache, [layer], self.runner.cfg.sliding_window)
        chunks = []
        for c, n in zip(call.chunks, call.num_tokens):
            tables = self.blocks.block_tables(c.seq_id) if self.blocks.has(c.seq_id) else None
            if tables is None or layer not in tables:
                raise LookupError(f"no KV of {c.seq_id} layer {layer} is kept here")
            if not self.blocks.allocate_layers(c.seq_id, [layer], c.start_pos + n):
                raise MemoryError(f"no KV block to grow {c.seq_id} layer {layer} to {c.start_pos + n} tokens")
            chunks.append(ScheduledChunk(c.seq_id, [0] * n, c.start_pos, {layer: tables[layer]}, None, True))
        with torch.inference_mode():
            att.prepare(chunks)
            out = att(layer, q, k, v)
        self.served += 1
        return out
