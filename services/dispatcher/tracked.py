"""One admitted request as its owning dispatcher tracks it: where it runs and what it has emitted.

Pure state, no I/O. The stream progress (`emitted`, `next_seq`) is what a re-dispatch needs:
the tokens the client already has (re-prefilled by the next worker, not emitted again) and
the seq number the next worker continues from.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.events import Assignment, SubmitRequest, TokenChunk
from shared.policy.routing import RequestView

MAX_EARLY_CHUNKS = 1024  # chunks held ahead of a gap in seq (a gap this long means lost messages)


class Phase(enum.StrEnum):
    QUEUED = "queued"  # in the admission queue (first dispatch, a re-dispatch, or after a rejection)
    ASSIGNING = "assigning"  # an Assignment is on its way to a worker, no reply yet
    RUNNING = "running"  # a worker accepted it (or its chunks arrived)


@dataclass(slots=True)
class TrackedRequest:
    submit: SubmitRequest
    admitted_ts: float
    phase: Phase = Phase.QUEUED
    queued_ts: float = 0.0
    redispatched: bool = False  # queued again after a worker died: goes before new requests
    attempt: int = 0  # re-dispatches so far; Assignment.attempt
    sends: int = 0  # Assignments sent in this attempt (a resend after a rejection gets a new key)
    pending_key: str | None = None  # idempotency key of the Assignment awaiting its reply
    timeouts: int = 0  # consecutive assignment replies that never came
    worker_id: str | None = None
    instance_id: str | None = None
    incarnation: str | None = None  # of the worker when assigned (a restart loses the request)
    emitted: list[int] = field(default_factory=list)  # token ids the client has, in seq order
    next_seq: int = 0
    early: dict[int, list[int]] = field(default_factory=dict)  # chunks past a seq gap
    avoid: dict[str, float] = field(default_factory=dict)  # instance id -> until (rejected us)
    abandoned: set[str] = field(default_factory=set)  # workers given up on (their late chunks are ignored)
    told_to_stop: set[str] = field(default_factory=set)  # workers given up on that were sent a targeted abort
    handover: int = 0  # the latest live migration of this attempt seen in its chunks ...
    handover_seq: int = 0  # ... and the seq its owner took the stream over at

    @property
    def request_id(self) -> str:
        return self.submit.request_id

    @property
    def model(self) -> str:
        return self.submit.model

    @property
    def prefill_tokens(self) -> int:
        """Tokens the next worker must prefill: the prompt plus what was already emitted."""
        return len(self.submit.prompt_token_ids) + len(self.emitted)

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request_id, model=self.model, prompt_tokens=self.prefill_tokens,
            max_tokens=max(1, self.submit.sampling.max_tokens - len(self.emitted)), adapter=self.submit.adapter,
        )

    def avoided(self, instance_id: str, now: float) -> bool:
        until = self.avoid.get(instance_id)
        return until is not None and now < until

    def next_key(self) -> str:
        """The idempotency key of a new Assignment: `<request_id>:<attempt>`, and `...-<n>` for the
        n-th resend of the same attempt after a rejection (a new command, so a new key; a retry
        after a lost reply reuses `pending_key` instead, so the worker applies it once)."""
        key = f"{self.request_id}:{self.attempt}" if self.sends == 0 else f"{self.request_id}:{self.attempt}-{self.sends}"
        self.sends += 1
        return key

    def new_attempt(self, lost_worker: str) -> None:
        """The worker running it is gone: the next Assignment is a re-dispatch (attempt + 1)."""
        self.abandoned.add(lost_worker)
        self.attempt += 1
        self.handover = self.handover_seq = 0
        self.sends = 0
        self.timeouts = 0
        self.pending_key = None
        self.redispatched = True

    def assignment(self, instance_id: str, key: str) -> Assignment:
        s = self.submit
        return Assignment(
            idempotency_key=key, request_id=s.request_id, instance_id=instance_id, model=s.model, adapter=s.adapter,
            prompt_token_ids=s.prompt_token_ids, sampling=s.sampling, priority=s.priority, arrival_ts=s.arrival_ts,
            deadline_ts=s.deadline_ts, attempt=self.attempt, resume_token_ids=list(self.emitted),
            next_seq=self.next_seq,
        )

    def current(self, attempt: int, handover: int, seq: int) -> bool:
        """Whether a message of assignment (attempt, handover) at `seq` belongs to the stream (the fence
        of shared/events/stream.py); a newer hand-over seen here takes the stream over at its seq."""
        if attempt != self.attempt:
            return attempt > self.attempt
        if handover > self.handover:
            self.handover, self.handover_seq = handover, seq
        return handover == self.handover or seq < self.handover_seq

    def record_chunk(self, chunk: TokenChunk) -> bool:
        """Fold a chunk into the stream progress (duplicates and old seqs are ignored).

        Returns False when too many chunks are held past a gap (tracking gave up on order).
        """
        if chunk.seq < self.next_seq or chunk.seq in self.early:
            return True
        self.early[chunk.seq] = list(chunk.token_ids)
        while self.next_seq in self.early:
            self.emitted.extend(self.early.pop(self.next_seq))
            self.next_seq += 1
        return len(self.early) <= MAX_EARLY_CHUNKS
