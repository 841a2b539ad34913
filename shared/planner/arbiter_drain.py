"""The drain the arbiter prices waiting with, measured (issue 32 item 2): per instance, the KV bytes its
requests released per second over the last horizon, read from successive cluster views (a request in one
view and gone from the next freed what it held there: it finished, was aborted or moved out).

It replaces `kv_used / request_time_s`, a constant ([planner] request_time) that moved the reserve price
15x. Pure: no I/O, no clock (the views' `now`).
"""
from __future__ import annotations

from collections import deque

from shared.planner.view import ClusterView


class DrainMeter:
    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"drain meter: window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._held: dict[str, dict[str, int]] = {}  # instance -> request id -> KV bytes, at the last view
        self._since: dict[str, float] = {}  # instance -> when it was first seen
        self._freed: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, view: ClusterView) -> dict[str, float]:
        """Read one view; the measured drain (bytes/s) of every instance seen at least twice."""
        now, seen = view.now, set()
        for w in view.usable_workers():
            for inst in w.instances:
                iid = inst.instance_id
                seen.add(iid)
                held = {r.request_id: r.kv_bytes for r in inst.requests}
                before = self._held.get(iid)
                if before is None:
                    self._since[iid] = now
                    self._freed[iid] = deque()
                else:
                    gone = sum(b for rid, b in before.items() if rid not in held)
                    if gone:
                        self._freed[iid].append((now, gone))
                self._held[iid] = held
                q = self._freed[iid]
                while q and q[0][0] <= now - self.window_s:
                    q.popleft()
        for iid in [i for i in self._held if i not in seen]:  # an instance gone from the view
            del self._held[iid], self._since[iid], self._freed[iid]
        return {iid: self.drain(iid, now) for iid in self._held if now > self._since[iid]}

    def drain(self, instance_id: str, now: float) -> float:
        """Bytes per second over the window, or over the time observed while it is shorter."""
        q = self._freed.get(instance_id)
        if q is None or now <= self._since[instance_id]:
            raise KeyError(f"drain meter: instance {instance_id!r} not observed twice yet")
        return sum(b for _, b in q) / min(self.window_s, now - self._since[instance_id])


__all__ = ["DrainMeter"]
