"""Requests for a model with no live instance: queued, and the planner asked for one (pure; no I/O).

With `[dispatcher] scale_from_zero = true`, a request for a catalog model that no live instance
serves (never placed, or scaled to zero) is not refused: it waits in the model's admission queue
— bounded by `queue_bound`; past it the submit is refused `no_capacity` (the gateway's 503 with
Retry-After) — and the dispatcher asks the planner for capacity (`CapacityRequest` on
`tidal.v1.planner.capacity`), again every `ASK_EVERY_S` while the model is still cold and requests
wait. The queued requests are dispatched when an instance registers (its WorkerStats); their wait
counts toward their TTFT. With the setting off (the default), such a submit is refused
`no_capacity` at once, as before.
"""
from __future__ import annotations

from dataclasses import dataclass

ASK_EVERY_S = 2.0  # a cold model's capacity request is repeated this often while requests wait


@dataclass(frozen=True, slots=True)
class RequestCapacity:
    """Effect: request/reply `CapacityRequest` on `tidal.v1.planner.capacity` (answered by the planner)."""

    model: str
    adapter: str | None
    queued_requests: int
    queued_prompt_tokens: int


class CapacityAsks:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._asked: dict[str, float] = {}  # model -> when the planner was last asked

    def ask(self, model: str, adapter: str | None, queued: int, prompt_tokens: int,
            now: float) -> list[RequestCapacity]:
        """Ask for `model` unless asked within ASK_EVERY_S."""
        if not self.enabled or now - self._asked.get(model, float("-inf")) < ASK_EVERY_S:
            return []
        self._asked[model] = now
        return [RequestCapacity(model, adapter, queued, prompt_tokens)]

    def served(self, model: str) -> None:
        """An instance registered: the next cold spell asks at once."""
        self._asked.pop(model, None)


def cold_queue_full_message(model: str, bound: int) -> str:
    return (f"no instance of {model!r} is running and {bound} requests already wait for one to start; "
            "retry later")


__all__ = ["ASK_EVERY_S", "CapacityAsks", "RequestCapacity", "cold_queue_full_message"]
