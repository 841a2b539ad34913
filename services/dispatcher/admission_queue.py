"""The bounded admission queue of each base model (pure; no I/O).

Order: re-dispatched requests first (their clients are mid-stream), then higher priority,
then arrival. The bound applies to new admissions only: a request already admitted (a
re-dispatch, or one a worker turned away) always gets back in, so the queue never drops a
request it accepted.
"""
from __future__ import annotations

import heapq
import itertools

from services.dispatcher.tracked import TrackedRequest

_Key = tuple[int, int, int]  # (0 re-dispatch / 1 new, -priority, arrival order)


class AdmissionQueues:
    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"queue bound: expected >= 1, got {bound}")
        self.bound = bound
        self._heaps: dict[str, list[tuple[_Key, str]]] = {}
        self._members: dict[str, tuple[str, _Key]] = {}  # request id -> (model, key)
        self._sizes: dict[str, int] = {}
        self._prompt_tokens: dict[str, int] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._members

    def size(self, model: str) -> int:
        return self._sizes.get(model, 0)

    def queued_prompt_tokens(self, model: str) -> int:
        return self._prompt_tokens.get(model, 0)

    def models(self) -> list[str]:
        return [m for m, n in self._sizes.items() if n]

    def full(self, model: str) -> bool:
        return self.size(model) >= self.bound

    def push(self, req: TrackedRequest) -> int:
        """Queue a request (ignoring the bound: callers check `full` for new admissions); returns
        its position (1 = next)."""
        if req.request_id in self._members:
            raise ValueError(f"request {req.request_id} is already queued")
        key = (0 if req.redispatched else 1, -req.submit.priority, next(self._order))
        model = req.model
        heapq.heappush(self._heaps.setdefault(model, []), (key, req.request_id))
        self._members[req.request_id] = (model, key)
        self._sizes[model] = self._sizes.get(model, 0) + 1
        self._prompt_tokens[model] = self._prompt_tokens.get(model, 0) + req.prefill_tokens
        return self.position(req.request_id)

    def remove(self, req: TrackedRequest) -> bool:
        """Take a request out (lazily: its heap entry is skipped later)."""
        member = self._members.pop(req.request_id, None)
        if member is None:
            return False
        model = member[0]
        self._sizes[model] -= 1
        self._prompt_tokens[model] -= req.prefill_tokens
        if not self._sizes[model]:
            del self._sizes[model], self._prompt_tokens[model], self._heaps[model]
        elif len(self._heaps[model]) > 2 * self._sizes[model] + 64:
            self.in_order(model)  # bound the stale entries lazy removal leaves behind
        return True

    def in_order(self, model: str) -> list[str]:
        """Request ids of a model's queue, next first (compacts the heap as a side effect)."""
        heap = self._heaps.get(model)
        if not heap:
            return []
        live = [(key, rid) for key, rid in heap if self._members.get(rid, (None, None))[1] == key]
        live.sort()
        self._heaps[model] = live  # a sorted list is a valid heap
        return [rid for _key, rid in live]

    def position(self, request_id: str) -> int:
        member = self._members.get(request_id)
        if member is None:
            return 0
        model, key = member
        return 1 + sum(1 for k, rid in self._heaps[model] if k < key and self._members.get(rid, (None, None))[1] == k)
