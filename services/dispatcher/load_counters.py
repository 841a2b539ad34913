"""Per-model traffic counters over a stats interval -> `DispatchStats` (pure; time passed in)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.events import DispatchStats, ModelLoad

_Key = tuple[str, str | None]  # (model, adapter)


@dataclass(slots=True)
class _Counts:
    arrivals: int = 0
    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


class LoadCounters:
    def __init__(self, dispatcher_id: str, started: float) -> None:
        self.dispatcher_id = dispatcher_id
        self.interval_start = started
        self._counts: dict[_Key, _Counts] = {}

    def _get(self, model: str, adapter: str | None) -> _Counts:
        key = (model, adapter)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Counts()
        return counts

    def arrival(self, model: str, adapter: str | None, prompt_tokens: int, admitted: bool) -> None:
        c = self._get(model, adapter)
        c.arrivals += 1
        c.prompt_tokens += prompt_tokens
        if admitted:
            c.admitted += 1
        else:
            c.rejected += 1

    def completion(self, model: str, adapter: str | None, output_tokens: int) -> None:
        c = self._get(model, adapter)
        c.completed += 1
        c.output_tokens += output_tokens

    def take(self, now: float, queued: dict[str, tuple[int, int]]) -> DispatchStats:
        """The interval's stats (queued: model -> (requests, prompt tokens) now); starts the next."""
        interval = max(now - self.interval_start, 1e-3)
        models: list[ModelLoad] = []
        keys = set(self._counts) | {(m, None) for m in queued}
        for model, adapter in sorted(keys, key=lambda k: (k[0], k[1] or "")):
            c = self._counts.get((model, adapter), _Counts())
            q, q_tokens = queued.get(model, (0, 0)) if adapter is None else (0, 0)
            models.append(ModelLoad(
                model=model, adapter=adapter, arrivals=c.arrivals, admitted=c.admitted, rejected=c.rejected,
                completed=c.completed, queued=q, queued_prompt_tokens=q_tokens, prompt_tokens=c.prompt_tokens,
                output_tokens=c.output_tokens,
            ))
        self._counts = {}
        self.interval_start = now
        return DispatchStats(dispatcher_id=self.dispatcher_id, ts=now, interval_s=min(interval, 3600.0),
                             models=models[:4096])
