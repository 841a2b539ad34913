"""Family `dispatch`: the gateway submits generation requests; the dispatcher reports load.

Subjects: `tidal.v1.dispatch.submit` (request/reply, queue group `dispatcher`) and
`tidal.v1.evt.dispatch.stats` (pub/sub). Tokens never come back on the submit reply: they
stream on `tidal.v1.req.<request_id>.out` (family `stream`), which the submitter subscribes
to *before* submitting.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    MAX_LIST, MAX_PROMPT_TOKENS, AdapterName, Count, InstanceId, Message, ModelName, Rate, Reason,
    RequestId, Seconds, ServiceId, Timestamp, TokenId, Value, WorkerId,
)
from shared.events.common import SamplingParams

Priority = Annotated[int, Meta(ge=-100, le=100, description="Higher is served first; 0 is normal.")]
PromptTokens = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class SubmitRequest(Message, kw_only=True):
    """One generation (one sequence): the gateway has already tokenized and bounded it.

    An OpenAI request with `n > 1` is submitted as n SubmitRequests with distinct ids.
    """

    request_id: RequestId
    model: ModelName  # the base model
    adapter: AdapterName | None = None  # a LoRA adapter of `model`, or None for the base
    prompt_token_ids: PromptTokens
    sampling: SamplingParams = SamplingParams()
    priority: Priority = 0
    arrival_ts: Timestamp  # when the gateway received the HTTP request
    deadline_ts: Timestamp | None = None  # give up (abort) if not finished by then


class SubmitAccepted(Message, kw_only=True):
    """Admitted: assigned to a worker at once, or queued (`worker_id` None) until capacity frees."""

    request_id: RequestId
    worker_id: WorkerId | None = None
    instance_id: InstanceId | None = None
    queue_position: Count = 0  # 0 when assigned


SubmitRejectReason = Literal[
    "queue_full",  # the model's admission queue is at its bound (HTTP 429)
    "no_capacity",  # no instance can take it and none is coming (HTTP 503)
    "model_not_found",  # unknown model or adapter (HTTP 404)
    "context_length_exceeded",  # prompt + max_tokens exceed the model's context (HTTP 400)
    "draining",  # the dispatcher is shutting down; retry elsewhere (HTTP 503)
]


class SubmitRejected(Message, kw_only=True):
    """Not admitted; nothing will be published on the request's out subject."""

    request_id: RequestId
    reason: SubmitRejectReason
    message: Reason
    retry_after_s: Seconds | None = None


SubmitReply = SubmitAccepted | SubmitRejected


class ModelLoad(Value, kw_only=True):
    """Traffic of one model (or one adapter of it) over a stats interval."""

    model: ModelName
    adapter: AdapterName | None = None
    arrivals: Count = 0  # submits received
    admitted: Count = 0
    rejected: Count = 0
    completed: Count = 0
    queued: Count = 0  # waiting in the admission queue at the end of the interval
    queued_prompt_tokens: Count = 0
    prompt_tokens: Count = 0  # of the arrivals
    output_tokens: Count = 0  # generated for requests completed in the interval


class DispatchStats(Message, kw_only=True):
    """Per-model arrivals and queues of one dispatcher, every stats interval (the predictor's input)."""

    dispatcher_id: ServiceId
    ts: Timestamp  # end of the interval
    interval_s: Annotated[float, Meta(gt=0, le=3600)]
    models: Annotated[list[ModelLoad], Meta(max_length=MAX_LIST)] = []

    def arrival_rate(self, model: ModelName) -> Rate:
        return sum(m.arrivals for m in self.models if m.model == model) / self.interval_s


__all__ = [
    "DispatchStats",
    "ModelLoad",
    "Priority",
    "SubmitAccepted",
    "SubmitRejectReason",
    "SubmitRejected",
    "SubmitReply",
    "SubmitRequest",
]
