"""Put one request's stream messages in `seq` order, each once. Pure (no I/O, no clock).

Chunks are delivered at least once and, across a re-dispatch, by two publishers, so a chunk
may repeat (dropped) or arrive ahead of one still in flight (held until the gap fills). A gap
that never fills is skipped when too many chunks are held, or when the caller gives up
waiting (`skip_gap`), so a lost message costs its tokens, never the stream.
"""
from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Sequenced(Protocol):
    @property
    def seq(self) -> int: ...


M = TypeVar("M", bound=Sequenced)


class SeqOrder(Generic[M]):
    def __init__(self, max_held: int = 64) -> None:
        self.next_seq = 0
        self.max_held = max_held
        self.held: dict[int, M] = {}
        self.duplicates = 0
        self.skipped = 0  # sequence numbers never received

    @property
    def waiting(self) -> bool:
        """Messages are held behind a gap."""
        return bool(self.held)

    def push(self, msg: M) -> list[M]:
        """The messages now deliverable, in order (empty if `msg` is a duplicate or early)."""
        seq = msg.seq
        if seq == self.next_seq and not self.held:  # the common case
            self.next_seq = seq + 1
            return [msg]
        if seq < self.next_seq or seq in self.held:
            self.duplicates += 1
            return []
        self.held[seq] = msg
        if len(self.held) > self.max_held:
            return self.skip_gap()
        return self._drain()

    def skip_gap(self) -> list[M]:
        """Give up on the missing sequence numbers before the first held message."""
        if not self.held:
            return []
        first = min(self.held)
        self.skipped += first - self.next_seq
        self.next_seq = first
        return self._drain()

    def _drain(self) -> list[M]:
        out: list[M] = []
        while self.next_seq in self.held:
            out.append(self.held.pop(self.next_seq))
            self.next_seq += 1
        return out


__all__ = ["SeqOrder"]
