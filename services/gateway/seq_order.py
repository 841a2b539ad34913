"""Put one request's stream messages in `seq` order, each once, from its current assignment only.

Pure (no I/O, no clock). Chunks are delivered at least once and, across a re-dispatch or a
migration, by two publishers, so a chunk may repeat (dropped) or arrive ahead of one still in
flight (held until the gap fills). A gap that never fills is skipped when too many chunks are
held, or when the caller gives up waiting (`skip_gap`), so a lost message costs its tokens,
never the stream.

The fence (shared/events/stream.py): every worker message names its assignment
(`attempt`, `handover`), which only grows. A newer assignment takes the stream over at a
seq — `StreamReassigned.from_seq` (a re-dispatch, announced by the dispatcher before the new
worker starts) or the seq of the new owner's first chunk (a migration) — and from then on
a message of an older assignment at or past that seq is stale and dropped. Older messages
before it are still the old owner's valid tokens (in flight). If a stale worker's message
was already delivered past the fence (it beat the dispatcher's announcement), the two
continuations cannot be joined exactly: the stream is `broken` and its caller ends it with
an error instead of text that mixes two workers'.
"""
from __future__ import annotations

from shared.events.stream import StreamError, StreamReassigned, TokenChunk

Ordered = TokenChunk | StreamError
Epoch = tuple[int, int]  # (attempt, handover)


class SeqOrder:
    def __init__(self, max_held: int = 64) -> None:
        self.next_seq = 0
        self.max_held = max_held
        self.held: dict[int, Ordered] = {}
        self.epoch: Epoch = (0, 0)  # the current assignment
        self.fence_seq = 0  # it owns the stream from this seq on
        self.duplicates = 0
        self.skipped = 0  # sequence numbers never received
        self.stale = 0  # messages of superseded assignments dropped
        self.broken: str | None = None  # why the stream cannot go on exactly (then nothing more is delivered)

    @property
    def waiting(self) -> bool:
        """Messages are held behind a gap."""
        return bool(self.held)

    def push(self, msg: Ordered | StreamReassigned) -> list[Ordered]:
        """The messages now deliverable, in order (empty if `msg` is a duplicate, stale or early)."""
        if self.broken is not None:
            return []
        if isinstance(msg, StreamReassigned):
            self._take_over((msg.attempt, 0), msg.from_seq)
            return self._drain()
        if isinstance(msg, StreamError) and msg.worker_id is None:
            return self._authoritative(msg)
        epoch = (msg.attempt, msg.handover)
        if epoch < self.epoch:
            if msg.seq >= self.fence_seq:
                self.stale += 1
                return []
        elif epoch > self.epoch:
            self._take_over(epoch, msg.seq)
            if self.broken is not None:
                return []
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

    def _take_over(self, epoch: Epoch, from_seq: int) -> None:
        """A newer assignment owns the stream from `from_seq` on."""
        if epoch <= self.epoch:
            return
        if self.next_seq > from_seq:
            self.broken = (f"seq {from_seq}.. of assignment {epoch} had already come from a superseded "
                           f"assignment (delivered up to {self.next_seq - 1})")
            self.held.clear()
            return
        self.epoch, self.fence_seq = epoch, from_seq
        for seq, held in list(self.held.items()):
            if seq >= from_seq and _epoch(held) < epoch:
                del self.held[seq]
                self.stale += 1

    def _authoritative(self, error: StreamError) -> list[Ordered]:
        """The dispatcher's error ends the stream; after the messages before its seq, or at once if
        this gateway is already past it (the dispatcher had seen less than we have)."""
        if error.seq <= self.next_seq:
            self.held.clear()
            self.next_seq = max(self.next_seq, error.seq + 1)
            return [error]
        self.held[error.seq] = error
        return self._drain()

    def skip_gap(self) -> list[Ordered]:
        """Give up on the missing sequence numbers before the first held message."""
        if not self.held:
            return []
        first = min(self.held)
        self.skipped += first - self.next_seq
        self.next_seq = first
        return self._drain()

    def _drain(self) -> list[Ordered]:
        out: list[Ordered] = []
        while self.next_seq in self.held:
            out.append(self.held.pop(self.next_seq))
            self.next_seq += 1
        return out


def _epoch(msg: Ordered) -> Epoch:
    if isinstance(msg, StreamError) and msg.worker_id is None:
        return (1 << 30, 0)  # the dispatcher's word is never superseded
    return (msg.attempt, msg.handover)


__all__ = ["Epoch", "Ordered", "SeqOrder"]
