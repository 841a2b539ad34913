"""Live KV migration, the engine's side (Llumnix pre-copy, the KV path of MELL §V).

The source reads a running request's progress (`kv_progress`) and sends its FULL blocks
while it keeps decoding — a block below `num_computed_tokens // block_size` is never
written again, since attention only writes the slots of new tokens; then, in one short
stop between two steps, it takes the request out keeping its blocks (`detach(keep_kv=True)`),
sends the rest (the partial tail) and frees them (`release_kv`). The destination allocates
blocks for a request it does not run yet (`reserve_kv`, growable), lets the data plane fill
them through `kv_views`, and admits the request on top of them (`attach`). A failed
migration attaches the request back on the source, whose blocks are still held.

Held/reserved blocks live in the block manager under the request id, outside the
scheduler: never preempted, never reclaimed by the pool (only free blocks are), counted as
used. The KV storage never moves (`kv_cache`: one region reserved for the pool's maximum),
so views stay valid while the engine steps other requests. Call everything from the
engine's owner thread, between steps; the data plane may read/write the views meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.gpu_worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from services.gpu_worker.engine.block_manager import BlockManager
    from services.gpu_worker.engine.model_runner import ModelRunner
    from services.gpu_worker.engine.sampler import Sampler
    from services.gpu_worker.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class KvProgress:
    """Where a request in the engine stands; cheap (ids only, no KV copied)."""

    request_id: str
    num_tokens: int  # prompt + output tokens so far
    num_computed_tokens: int  # tokens whose KV is written
    full_blocks: int  # num_computed_tokens // block_size: blocks never written again
    num_blocks: int  # blocks the request holds per layer
    tables: dict[int, list[int]]  # layer -> block ids (a copy)
    num_preemptions: int = 0  # changes when a preemption dropped its KV: copied blocks are stale


@dataclass(frozen=True, slots=True)
class DetachedRequest:
    """Everything needed to continue a request elsewhere (or here again, via attach)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int  # KV present (held) for this many tokens; 0 if none is kept
    params: SamplingParams
    adapter: str | None
    priority: int  # the engine's (lower = more urgent): pass it back to attach as is
    tables: dict[int, list[int]]  # the blocks it still holds if keep_kv, else {}


def _copy(tables: dict[int, list[int]]) -> dict[int, list[int]]:
    return {layer: list(ids) for layer, ids in tables.items()}


class KvHandover:
    """LLMEngine's migration calls (a mixin: it uses the engine's parts below)."""

    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    max_model_len: int
    _requests: dict[str, Any]
    _held_kv: set[str]

    def kv_progress(self, request_id: str) -> KvProgress | None:
        """The request's KV progress; None if it is not in the engine (finished, aborted, detached)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        seq = req.seq
        tables = _copy(self.blocks.block_tables(request_id)) if self.blocks.has(request_id) else {}
        return KvProgress(
            request_id=request_id, num_tokens=seq.num_tokens, num_computed_tokens=seq.num_computed_tokens,
            full_blocks=seq.num_computed_tokens // self.blocks.block_size, num_blocks=self._covered_blocks(request_id),
            tables=tables, num_preemptions=seq.num_preemptions,
        )

    def detach(self, request_id: str, *, keep_kv: bool) -> DetachedRequest | None:
        """Take a running or waiting request out without any output. keep_kv: its blocks stay
        allocated, held under its id until release_kv() or attach(); else they are freed now.
        None if it is not in the engine."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        seq = self.scheduler.detach(request_id, free_blocks=not keep_kv)
        assert seq is not None, f"request {request_id} was in the engine but not in its scheduler"
        self.sampler.forget(request_id)
        tables: dict[int, list[int]] = {}
        if keep_kv:
            self._held_kv.add(request_id)
            if self.blocks.has(request_id):
                tables = _copy(self.blocks.block_tables(request_id))
        return DetachedRequest(
            request_id=request_id, prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            num_computed_tokens=seq.num_computed_tokens if keep_kv else 0, params=seq.params,
            adapter=seq.adapter, priority=seq.priority, tables=tables,
        )

    def reserve_kv(self, request_id: str, num_tokens: int, *, expected_tokens: int = 0) -> dict[int, list[int]] | None:
        """Blocks for `num_tokens` tokens on every KV layer, held for a request NOT in the engine
        (a migration's destination); a larger count later grows the same tables (earlier ids
        unchanged). None, with nothing (more) allocated, if there is no room. `expected_tokens`
        (e.g. prompt + max_tokens) keeps the chain contiguous as it grows."""
        if request_id in self._requests:
            raise ValueError(f"reserve_kv: request {request_id!r} is running in this engine")
        if num_tokens < 0:
            raise ValueError(f"reserve_kv: request {request_id}: num_tokens must be >= 0, got {num_tokens}")
        self.blocks.sync_with_pool()  # bytes freed since the last step become blocks now
        if not self.blocks.allocate(request_id, num_tokens, expected_tokens):
            return None
        self._held_kv.add(request_id)
        return _copy(self.blocks.block_tables(request_id))

    def release_kv(self, request_id: str) -> int:
        """Free the blocks held/reserved under request_id; returns how many (0: none held —
        a request running in the engine is never touched)."""
        if request_id not in self._held_kv:
            return 0
        self._held_kv.discard(request_id)
        return self.blocks.free(request_id)

    def attach(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        output_token_ids: list[int], num_computed_tokens: int, adapter: str | None = None,
        priority: int = 0, arrival_time: float | None = None,
    ) -> None:
        """Admit a request whose first num_computed_tokens tokens' KV is in the blocks held under
        its id. It continues as if it had never moved: outputs count toward max_tokens and are
        not emitted again (the detokenizer replays them), the rest of the prompt is prefilled
        in chunks or the next step decodes. ValueError naming the problem, with no state
        changed (held blocks stay held: release_kv them), if it cannot be admitted."""
        if request_id in self._requests:
            raise ValueError(f"attach: request id {request_id!r} is already in the engine")
        prompt, outputs = list(prompt_token_ids), list(output_token_ids)
        num_tokens = len(prompt) + len(outputs)
        if not isinstance(num_computed_tokens, int) or not 0 <= num_computed_tokens < max(1, num_tokens):
            raise ValueError(
                f"attach: request {request_id}: num_computed_tokens must be in [0, {num_tokens}) "
                f"(the last token is computed by the next step), got {num_computed_tokens}"
            )
        held = request_id in self._held_kv
        covered = self._covered_blocks(request_id) * self.blocks.block_size if held else 0
        if covered < num_computed_tokens:
            raise ValueError(
                f"attach: request {request_id}: the KV blocks held for it cover {covered} tokens, "
                f"fewer than num_computed_tokens={num_computed_tokens}" + ("" if held else " (reserve_kv first)")
            )
        req = self._make_request(request_id, prompt, params, outputs, adapter, priority, arrival_time)
        req.seq.num_computed_tokens = num_computed_tokens
        if num_computed_tokens == 0 and held:  # nothing to keep: a plain (re-)admission
            self.blocks.free(request_id)
        self.scheduler.attach(req.seq)  # validated above: cannot fail now
        self._held_kv.discard(request_id)
        self._requests[request_id] = req

    def kv_views(self, request_id: str, first_block: int, last_block: int) -> list[torch.Tensor]:
        """Views (no copies) of the request's blocks [first_block, last_block) on every KV layer,
        in `transfer.kv_blocks` stream order: source and destination get streams of equal
        length and layout for the same range."""
        if not self.blocks.has(request_id):
            raise ValueError(f"kv_views: request {request_id!r} holds no KV blocks here")
        have = self._covered_blocks(request_id)
        if not 0 <= first_block <= last_block <= have:
            raise ValueError(
                f"kv_views: request {request_id}: blocks [{first_block}, {last_block}) outside the {have} it holds"
            )
        from services.gpu_worker.transfer.kv_blocks import kv_block_views  # deferred: the package loads UCX

        return kv_block_views(self.runner.kv_cache, self.blocks.block_tables(request_id), first_block, last_block)

    def _covered_blocks(self, request_id: str) -> int:
        """Blocks held on EVERY KV layer (the tables normally have equal lengths)."""
        if not self.blocks.has(request_id):
            return 0
        tables = self.blocks.block_tables(request_id)
        return min((len(tables.get(layer, ())) for layer in self.blocks.layers), default=0)

    # provided by LLMEngine
    def _make_request(self, request_id: str, token_ids: list[int], params: SamplingParams, outputs: list[int],
                      adapter: str | None, priority: int, arrival_time: float | None) -> Any:
        raise NotImplementedError
