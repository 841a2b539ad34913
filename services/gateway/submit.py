"""What both generation endpoints share: request ids, SubmitRequests, and starting a Generation.

`start_generation` returns once the dispatcher admitted every sequence; any refusal is an
`ApiError` with its HTTP status, and nothing keeps running for the request.
"""
from __future__ import annotations

import secrets
import time

from services.gateway.catalog import Target
from services.gateway.errors import ApiError
from services.gateway.generation import Generation
from services.gateway.prep import Knobs, sampling_for
from services.gateway.state import GatewayState
from shared.events.dispatch import SubmitRequest
from shared.tracing import annotate_request

MAX_SEQUENCES = 128  # prompts x n per HTTP request


def new_id(prefix: str) -> str:
    """An OpenAI-style id; `<id>-<k>` is the request id of choice k (subject-token safe, < 64 chars)."""
    return f"{prefix}-{secrets.token_hex(12)}"


def build_submits(state: GatewayState, target: Target, prompts: list[list[int]], knobs: Knobs, *, base_id: str,
                  prompt_param: str) -> tuple[list[SubmitRequest], list[int]]:
    """One SubmitRequest per (prompt, sample), in OpenAI's choice order; and each one's prompt index."""
    if len(prompts) * knobs.n > MAX_SEQUENCES:
        raise ApiError.bad_request(f"prompts x n must be at most {MAX_SEQUENCES}, got {len(prompts) * knobs.n}",
                                   param="n")
    annotate_request(base_id)  # on the HTTP request's span, when traced
    arrival = time.time()
    deadline = arrival + state.request_timeout_s
    adapter = target.adapter.name if target.adapter is not None else None
    submits: list[SubmitRequest] = []
    groups: list[int] = []
    for p_index, ids in enumerate(prompts):
        for sample in range(knobs.n):
            sampling = sampling_for(knobs, prompt_len=len(ids), max_context=target.model.max_context,
                                    limits=state.limits, prompt_param=prompt_param, choice=sample)
            submits.append(SubmitRequest(
                request_id=f"{base_id}-{len(submits)}", model=target.model.name, adapter=adapter,
                prompt_token_ids=ids, sampling=sampling, arrival_ts=arrival, deadline_ts=deadline,
            ))
            groups.append(p_index)
    return submits, groups


async def start_generation(state: GatewayState, submits: list[SubmitRequest], groups: list[int], *, route: str,
                           prompt_param: str) -> Generation:
    hub = state.require_hub()
    gen = Generation(hub, submits, prompt_groups=groups, timeout_s=state.request_timeout_s, prompt_param=prompt_param,
                     stall_timeout_s=state.stream_stall_timeout_s)
    state.begin(gen, route)
    try:
        await gen.start()  # on refusal it has closed itself (and ended the in-flight count)
    except BaseException:
        await gen.close()  # idempotent; covers failures before the submits (e.g. NATS gone)
        raise
    return gen


__all__ = ["MAX_SEQUENCES", "build_submits", "new_id", "start_generation"]
