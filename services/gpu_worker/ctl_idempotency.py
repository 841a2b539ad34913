"""Control commands run once per idempotency key, each in a task of its own (model_ctl.py, adapter_ctl.py).

A command can take a while (weights or an adapter read from disk, a drain), so it runs in a task
and answers with `bus.respond`: the worker's mailbox goes on with assignments and aborts
meanwhile. Its outcome is remembered by key (the latest `memory` keys): a retry while it runs
waits for it, a retry after it gets the same `CtlDone` with `replayed=True`, and a key reused
for another command is refused `conflict`. A command that raised is forgotten — not applied as
far as we know, so a retry runs it again — and its caller gets a typed internal error.
"""
from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from shared.bus import Bus, Delivery
from shared.events.ctl import CtlDone, CtlRefused, CtlRefusedCode, CtlReply
from shared.wire import INTERNAL, ErrorReply


class KeyedCommand(Protocol):
    @property
    def idempotency_key(self) -> str: ...


C = TypeVar("C", bound=KeyedCommand)


class IdempotentCommands(Generic[C]):
    """`run` executes a command (it logs what it raises); `refused` builds the owner's CtlRefused;
    `spawn` runs a coroutine as the owner's task; `failed_message` is what a caller is told when
    `run` raised."""

    def __init__(self, *, run: Callable[[C], Awaitable[CtlReply]],
                 refused: Callable[[C, CtlRefusedCode, str], CtlRefused],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], failed_message: str, memory: int = 10_000) -> None:
        self._execute, self._refused, self._spawn = run, refused, spawn
        self.failed_message = failed_message
        self.memory = memory
        self.outcomes: collections.OrderedDict[str, tuple[C, asyncio.Future[CtlReply]]] = collections.OrderedDict()

    def handle(self, msg: C, ctx: Delivery, bus: Bus) -> CtlRefused | None:
        """Start `msg` (or wait for its first run again); None: answered later on `bus`."""
        seen = self.outcomes.get(msg.idempotency_key)
        if seen is not None:
            if seen[0] != msg:
                return self._refused(msg, "conflict", f"idempotency key {msg.idempotency_key!r} was already used "
                                                      "for another command")
            self._spawn(self._answer(bus, ctx, seen[1], replayed=True))
            return None
        outcome: asyncio.Future[CtlReply] = asyncio.get_running_loop().create_future()
        self.outcomes[msg.idempotency_key] = (msg, outcome)
        if len(self.outcomes) > self.memory:
            self.outcomes.popitem(last=False)
        self._spawn(self._run(msg, outcome))
        self._spawn(self._answer(bus, ctx, outcome, replayed=False))
        return None

    async def _run(self, msg: C, outcome: asyncio.Future[CtlReply]) -> None:
        try:
            reply = await self._execute(msg)
        except Exception as exc:  # logged by `run`; not applied as far as we know: a retry runs it again
            self.outcomes.pop(msg.idempotency_key, None)
            outcome.set_exception(exc)
            return
        outcome.set_result(reply)

    async def _answer(self, bus: Bus, ctx: Delivery, outcome: asyncio.Future[CtlReply], *, replayed: bool) -> None:
        try:
            reply = await asyncio.shield(outcome)
        except Exception:  # the caller gets a typed internal error
            if ctx.reply:
                await bus.respond_error(ctx.reply, ErrorReply(code=INTERNAL, message=self.failed_message))
            return
        if replayed and isinstance(reply, CtlDone):
            reply = msgspec.structs.replace(reply, replayed=True)
        if ctx.reply:
            await bus.respond(ctx, reply)
