"""`tidal bench transfer --trace`: where an activation's latency goes, step by step.

Both processes record `services.gpu_worker.transfer.timeline` steps on one clock
(CLOCK_MONOTONIC); this joins them per activation and splits submit -> ack into:

* queued     submit -> its chunk posted (waiting for the scheduler / an in-flight slot)
* to_rx      posted -> its TransferStart decoded by the receiver (frames through UCX, the
             receiver's notifier thread and event loop)
* payload    TransferStart decoded -> payload landed (the receive posted, rendezvous, copy)
* verify     landed -> verified (waiting for the chunk header, the checksum)
* ack        verified -> the sender read the Ack (reply through UCX and both threads)

and counts the bulk chunks that were on the wire (posted, not yet landed) at submit.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

Step = tuple[str, int, int, float]
SEGMENTS = ("queued", "to_rx", "payload", "verify", "ack")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def breakdown(sender: Iterable[Step], receiver: Iterable[Step], activations: set[int],
              bulk: set[int]) -> list[dict[str, float]]:
    """One row per fully traced activation: each segment in ms, `total`, `bulk_ahead`."""
    at: dict[tuple[str, int], float] = {}
    chunk_post: dict[tuple[int, int], float] = {}
    chunk_landed: dict[tuple[int, int], float] = {}
    for step, tid, index, t in list(sender) + list(receiver):
        if tid in bulk:
            if step == "post":
                chunk_post[(tid, index)] = t
            elif step == "landed":
                chunk_landed[(tid, index)] = t
        elif tid in activations:
            at.setdefault((step, tid), t)
    rows = []
    by_tid: dict[int, dict[str, float]] = defaultdict(dict)
    for (step, tid), t in at.items():
        by_tid[tid][step] = t
    for tid, s in by_tid.items():
        needed = ("submit", "post", "start", "landed", "verified", "ack")
        if not all(k in s for k in needed):
            continue
        marks = [s[k] for k in needed]
        row = {name: (b - a) * 1000 for name, a, b in zip(SEGMENTS, marks, marks[1:])}
        row["total"] = (s["ack"] - s["submit"]) * 1000
        row["bulk_ahead"] = float(sum(
            1 for key, posted in chunk_post.items()
            if posted <= s["submit"] and chunk_landed.get(key, float("inf")) > s["submit"]
        ))
        rows.append(row)
    return rows


def report(rows: list[dict[str, float]], indent: str = "    ") -> str:
    if not rows:
        return f"{indent}(no activation fully traced)"
    p99 = _pct([r["total"] for r in rows], 0.99)
    slow = [r for r in rows if r["total"] >= p99] or rows
    cols = (*SEGMENTS, "total", "bulk_ahead")
    lines = [f"{indent}{'ms':<22}" + "".join(f"{c:>11}" for c in cols)]
    for label, pick in (("P50 of each step", lambda v: _pct(v, 0.5)), ("P99 of each step", lambda v: _pct(v, 0.99))):
        lines.append(f"{indent}{label:<22}" + "".join(f"{pick([r[c] for r in rows]):>11.2f}" for c in cols))
    lines.append(f"{indent}{f'slowest 1% (n={len(slow)}), mean':<22}"
                 + "".join(f"{sum(r[c] for r in slow) / len(slow):>11.2f}" for c in cols))
    return "\n".join(lines)
