"""When `tidal up` restarts a child that died (pure; time passed in).

A child that exits on its own is restarted after an exponential backoff (1 s, 2 s, 4 s, ...
up to `max_backoff_s`); the backoff starts over once a child has run `window_s` without
crashing. More than `max_crashes` crashes within `window_s` and the launcher gives up on
that child (it stays down, is reported, and `tidal status` shows it unreachable); the rest
of the cluster keeps running.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_crashes: int = 5
    window_s: float = 60.0
    _crashes: dict[str, deque[float]] = field(default_factory=dict)

    def crashed(self, child: str, now: float, ran_s: float) -> float | None:
        """`child` died at `now` after running `ran_s`: seconds to wait before restarting it,
        or None to give up."""
        crashes = self._crashes.setdefault(child, deque())
        if ran_s >= self.window_s:
            crashes.clear()  # it had been healthy: start the backoff over
        crashes.append(now)
        while crashes and now - crashes[0] > self.window_s:
            crashes.popleft()
        if len(crashes) > self.max_crashes:
            return None
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (len(crashes) - 1))

    def crashes(self, child: str) -> int:
        return len(self._crashes.get(child, ()))
