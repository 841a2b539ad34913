"""One HTTP request's sequences on the cluster: submitted, streamed back in order, aborted if abandoned.

    gen = Generation(hub, submits, prompt_groups=[0, 0], timeout_s=600)
    await gen.start()                       # ApiError if the dispatcher refuses (nothing left running)
    async for batch in gen.batches():       # [(choice, TokenChunk | StreamError)], seq order per choice
        ...
    await gen.close()

Chunks arrive through a plain callback into a list and wake one waiter, so a burst of chunks
costs one wake-up. `abandon()` (client gone, deadline, shutdown) publishes an AbortRequest for
every unfinished sequence at once and ends `batches()` with `Abandoned`.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from services.gateway.errors import ApiError, log_failure
from services.gateway.hub import Sink, StreamHub, StreamMsg
from services.gateway.metrics import ABORTS, STREAM_ANOMALIES
from services.gateway.seq_order import SeqOrder
from shared.events.dispatch import SubmitRejected, SubmitRequest
from shared.events.common import Usage
from shared.events.stream import StreamError, TokenChunk
from shared.logging import get_logger, request_id_var
from shared.wire import DeadlineExceeded, NoResponders, RemoteError, TidalError, Unavailable

log = get_logger("tidal.gateway.generation")

AbandonReason = Literal["client_disconnected", "deadline", "cancelled"]
_DUPLICATES = STREAM_ANOMALIES.labels("duplicate")
_GAPS = STREAM_ANOMALIES.labels("gap_skipped")
_STALE = STREAM_ANOMALIES.labels("stale_assignment")


class Abandoned(Exception):
    def __init__(self, reason: AbandonReason) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Choice:
    index: int
    request_id: str
    prompt_group: int  # choices of one prompt share its prompt tokens in `usage`
    prompt_len: int
    order: SeqOrder = field(default_factory=SeqOrder)
    done: bool = False
    tokens: int = 0  # completion tokens received
    usage: Usage | None = None  # from the final chunk
    error: StreamError | None = None


class Generation:
    def __init__(self, hub: StreamHub, submits: list[SubmitRequest], *, prompt_groups: list[int], timeout_s: float,
                 prompt_param: str = "prompt", gap_wait_s: float = 0.5, stall_timeout_s: float = 0.0) -> None:
        self.hub = hub
        self.stall_timeout_s = stall_timeout_s  # no message this long: ended (stream_guard.py); 0: never
        self.submits = submits
        self.choices = [Choice(i, s.request_id, g, len(s.prompt_token_ids))
                        for i, (s, g) in enumerate(zip(submits, prompt_groups, strict=True))]
        self.timeout_s = timeout_s
        self.prompt_param = prompt_param
        self.gap_wait_s = gap_wait_s
        self.abandoned: AbandonReason | None = None
        self.unfinished = len(self.choices)
        self._inbox: list[tuple[Choice, StreamMsg]] = []
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._opened = False
        self._unanswered: set[str] = set()
        self.on_closed: Callable[[], None] | None = None  # the gateway's in-flight accounting

    # --- start: subscribe first, then submit ------------------------------------------------
    async def start(self) -> None:
        for choice in self.choices:
            await self.hub.open(choice.request_id, self._sink_for(choice))
        self._opened = True
        outcomes: list[BaseException | None]
        if len(self.submits) == 1:  # the common case: no task (and no loop turn) before the publish
            outcomes = [await self._submit_guarded(self.submits[0])]
        else:
            outcomes = await asyncio.gather(*(self._submit(s) for s in self.submits), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            # All or nothing: stop the sequences that got in, and those whose answer never came.
            accepted = [c for c, o in zip(self.choices, outcomes)
                        if not isinstance(o, BaseException) or c.request_id in self._unanswered]
            for choice in accepted:
                await self.hub.abort(choice.request_id, "cancelled")
            await self.close()
            error = next((f for f in failures if isinstance(f, ApiError)), None)
            if error is None:
                log_failure("submit failed", failures[0])
                error = ApiError.internal()
            raise error
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.timeout_s, self._on_deadline)

    async def _submit_guarded(self, request: SubmitRequest) -> BaseException | None:
        """`_submit` in the caller's task: its failure returned (as gather would), its request id unbound after."""
        token = request_id_var.set(request.request_id)
        try:
            await self._submit(request)
        except Exception as exc:
            return exc
        finally:
            request_id_var.reset(token)
        return None

    async def _submit(self, request: SubmitRequest) -> None:
        request_id_var.set(request.request_id)  # this task's own context: logs and NATS headers carry it
        try:
            reply = await self.hub.submit(request)
        except NoResponders:
            raise ApiError.unavailable("no_capacity", "No dispatcher is serving requests; retry later.", 2.0) from None
        except DeadlineExceeded:
            self._unanswered.add(request.request_id)  # it may have been admitted all the same
            raise ApiError.unavailable("no_capacity", "The dispatcher did not answer in time; retry later.", 1.0) \
                from None
        except RemoteError as exc:
            log.error("dispatcher refused the submit", code=exc.code, error=exc.message)
            raise ApiError.internal() from None
        except (Unavailable, TidalError):
            self._unanswered.add(request.request_id)
            raise ApiError.unavailable("no_capacity", "The cluster is not reachable; retry later.", 2.0) from None
        if isinstance(reply, SubmitRejected):
            raise self._rejection(reply)

    def _rejection(self, reply: SubmitRejected) -> ApiError:
        """The client's error for a refusal; the dispatcher's own text stays in the logs (it may name
        internals such as workers)."""
        log.debug("submit refused", reason=reply.reason, detail=reply.message, request_id=reply.request_id)
        retry = reply.retry_after_s
        match reply.reason:
            case "queue_full":
                return ApiError.queue_full("The model's request queue is full; retry later.", retry)
            case "no_capacity":
                return ApiError.unavailable("no_capacity", "No instance can serve this model now; retry later.", retry)
            case "draining":
                return ApiError.unavailable("draining", "The dispatcher is shutting down; retry later.", retry)
            case "model_not_found":
                return ApiError.model_not_found(self.submits[0].adapter or self.submits[0].model)
            case "context_length_exceeded":
                return ApiError.context_length("The prompt and max_tokens do not fit the model's context.",
                                               param=self.prompt_param)
        return ApiError.internal()

    # --- receiving --------------------------------------------------------------------------
    def _sink_for(self, choice: Choice) -> Sink:
        def sink(msg: StreamMsg) -> None:
            self._inbox.append((choice, msg))
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        return sink

    async def batches(self) -> AsyncIterator[list[tuple[Choice, StreamMsg]]]:
        """Ordered, de-duplicated messages until every choice has its final one."""
        loop = asyncio.get_running_loop()
        while self.unfinished:
            if not self._inbox and self.abandoned is None:
                self._waiter = loop.create_future()
                gap = any(c.order.waiting for c in self.choices)
                try:
                    if gap:
                        await asyncio.wait_for(self._waiter, self.gap_wait_s)
                    else:
                        await self._waiter
                except asyncio.TimeoutError:
                    yield self._skip_gaps()
                    continue
                finally:
                    self._waiter = None
            if self.abandoned is not None:
                raise Abandoned(self.abandoned)
            inbox, self._inbox = self._inbox, []
            out: list[tuple[Choice, StreamMsg]] = []
            for choice, msg in inbox:
                if choice.done:
                    continue
                before, stale = choice.order.duplicates, choice.order.stale
                for ordered in choice.order.push(msg):
                    self._accept(choice, ordered, out)
                if choice.order.duplicates != before:
                    _DUPLICATES.inc()
                if choice.order.stale != stale:
                    _STALE.inc(choice.order.stale - stale)
                if choice.order.broken is not None and not choice.done:
                    self._accept(choice, self._broken(choice), out)
            if out:
                yield out

    def _accept(self, choice: Choice, msg: StreamMsg, out: list[tuple[Choice, StreamMsg]]) -> None:
        if choice.done:
            return
        if isinstance(msg, TokenChunk):
            choice.tokens += len(msg.token_ids)
            if msg.usage is not None:
                choice.usage = msg.usage
        else:
            choice.error = msg
            choice.usage = msg.usage
        if isinstance(msg, StreamError) or msg.finish_reason is not None:
            choice.done = True
            self.unfinished -= 1
        out.append((choice, msg))

    @staticmethod
    def _broken(choice: Choice) -> StreamError:
        """The choice's end when a superseded worker's tokens reached the client past the re-dispatch's
        fence: what was sent is what that worker made, and the new worker cannot continue it exactly."""
        log.warning("stream superseded mid-chunk; ended with an error", request_id=choice.request_id,
                    why=choice.order.broken)
        return StreamError(request_id=choice.request_id, seq=choice.order.next_seq, code="worker_lost",
                           message="the worker serving this request was lost and its stream cannot be continued "
                                   "exactly; tokens already sent are valid")

    def _skip_gaps(self) -> list[tuple[Choice, StreamMsg]]:
        out: list[tuple[Choice, StreamMsg]] = []
        for choice in self.choices:
            if choice.order.waiting:
                before = choice.order.skipped
                for msg in choice.order.skip_gap():
                    self._accept(choice, msg, out)
                _GAPS.inc(choice.order.skipped - before)
                log.warning("token chunks lost; gap skipped", request_id=choice.request_id,
                            missing=choice.order.skipped - before)
        return out

    # --- ending -----------------------------------------------------------------------------
    def _on_deadline(self) -> None:
        asyncio.ensure_future(self.abandon("deadline"))

    async def abandon(self, reason: AbandonReason) -> None:
        """Stop every unfinished sequence now (publishes their AbortRequests) and end `batches()`."""
        if self.abandoned is not None or not self.unfinished:
            return
        self.abandoned = reason
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        aborts = ABORTS.labels(reason)
        for choice in self.choices:
            if not choice.done:
                aborts.inc()
                await self.hub.abort(choice.request_id, reason)

    def usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens): each prompt counted once, however many choices it has."""
        prompts: dict[int, int] = {}
        completion = 0
        for choice in self.choices:
            used = choice.usage
            prompt = used.prompt_tokens if used is not None else choice.prompt_len
            prompts[choice.prompt_group] = max(prompts.get(choice.prompt_group, 0), prompt)
            completion += used.completion_tokens if used is not None else choice.tokens
        return sum(prompts.values()), completion

    async def close(self) -> None:
        if self.on_closed is not None:
            self.on_closed()
            self.on_closed = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._opened:
            self._opened = False
            for choice in self.choices:
                await self.hub.close(choice.request_id)


__all__ = ["Abandoned", "AbandonReason", "Choice", "Generation"]
