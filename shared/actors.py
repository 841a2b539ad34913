"""A small actor runtime on top of the bus.

An `Actor` owns its state and handles its mailbox one message at a time (or up to a declared
`concurrency`). Subclasses bind typed subscriptions and spawn supervised background tasks in
`on_start`; a handler returning a Struct answers the request::

    class Registry(Actor):
        def __init__(self) -> None:
            super().__init__("registry")
            self.models: dict[str, ModelRecord] = {}

        async def on_start(self) -> None:
            await self.bind("tidal.v1.registry.get", GetModel, self.get, queue="registry")
            self.spawn("liveness", self.check_liveness)          # restarted with backoff if it crashes

        async def get(self, msg: GetModel, ctx: Delivery) -> ModelRecord:
            if msg.name not in self.models:
                raise NotFound(f"no model {msg.name!r}", field="name")   # → ErrorReply(code="not_found")
            return self.models[msg.name]

        async def check_liveness(self) -> None:
            while True:
                await asyncio.sleep(1)
                async with self.turn():      # takes a turn in the mailbox: no handler runs meanwhile
                    ...

Rules: state changes only inside handlers or `async with self.turn()`. A malformed or unknown
message gets a typed ErrorReply (where a reply is expected), is counted and logged (see
`shared.bus`); a handler exception becomes an `internal` ErrorReply with the traceback only in
the log. Neither stops the actor. `stop()` drains: stop receiving, finish what was received
within a deadline, then cancel background tasks and run `on_stop`.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from nats.aio.msg import Msg

from shared import metrics
from shared.bus import Bus, Handler, Subscription
from shared.logging import get_logger

log = get_logger("tidal.actors")

EscalateCallback = Callable[["Actor", str, BaseException], None]


@dataclass(frozen=True)
class RestartPolicy:
    """What the supervisor does when a background task raises.

    restart with exponential backoff (reset after the task ran `window_s` without crashing);
    escalate (tell the service, which shuts down with a failure exit code) when `restart` is
    False or when more than `max_restarts` crashes happen within `window_s`.
    """

    restart: bool = True
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    max_restarts: int | None = None
    window_s: float = 60.0


ESCALATE = RestartPolicy(restart=False)


class _Slots:
    """A FIFO semaphore whose uncontended acquire is a plain call (the mailbox hot path)."""

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_acquire(self) -> bool:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us just as we were cancelled: pass it on
            elif waiter in self.waiters:
                self.waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self.waiters:  # hand the slot straight to the next waiter, in arrival order
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class Actor:
    """Owns state; handles its messages one at a time (or `concurrency` at a time)."""

    def __init__(self, name: str | None = None, *, concurrency: int = 1) -> None:
        if concurrency < 1:
            raise ValueError(f"actor concurrency: expected >= 1, got {concurrency}")
        self.name = name or type(self).__name__
        self.concurrency = concurrency
        self.accepting = False
        self._bus: Bus | None = None
        self._slots = _Slots(concurrency)
        self._subs: list[Subscription] = []
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._background: dict[str, asyncio.Task[None]] = {}
        self._inflight = 0
        self._on_escalate: EscalateCallback | None = None
        self._forced = asyncio.Event()

    # --- for subclasses -----------------------------------------------------------------
    async def on_start(self) -> None:
        """Bind subscriptions and spawn tasks here."""

    async def on_stop(self) -> None:
        """Release resources here (runs after the mailbox drained)."""

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError(f"actor {self.name} is not started")
        return self._bus

    async def bind(
        self, subject: str, msg_type: Any, handler: Handler, *, queue: str | None = None, label: str | None = None,
        flush: bool = True,
    ) -> Subscription:
        """Subscribe `handler` through this actor's mailbox (typed; options as in `Bus.subscribe`)."""
        sub = await self.bus.subscribe(subject, msg_type, handler, queue=queue, label=label, mailbox=self, flush=flush)
        self._subs.append(sub)
        return sub

    async def unbind(self, sub: Subscription) -> None:
        """Stop a subscription made with `bind`, finishing what it already received."""
        if sub in self._subs:
            self._subs.remove(sub)
        await sub.drain()

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]], *, policy: RestartPolicy = RestartPolicy()) -> None:
        """Run `factory()` as a supervised background task (cancelled at stop)."""
        if name in self._background and not self._background[name].done():
            raise ValueError(f"actor {self.name}: task {name!r} is already running")
        # A fresh context: a task spawned from a handler must not inherit that message's deadline.
        self._background[name] = asyncio.get_running_loop().create_task(
            self._supervise(name, factory, policy), name=f"{self.name}.{name}", context=contextvars.Context()
        )

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Take one mailbox slot (exclusive with handlers when concurrency is 1).

        For background tasks only: a handler already holds a slot, so with concurrency 1 a
        handler that waits for a turn waits for itself.
        """
        await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()

    # --- mailbox (the bus calls this for every message of a bound subscription) ---------
    async def deliver(self, process: Callable[[Msg], Awaitable[None]], raw: Msg) -> None:
        slots = self._slots
        if not slots.try_acquire():
            await slots.acquire()  # back-pressure: the subscription waits while we are full
        self._inflight += 1
        if self.concurrency == 1:  # inline: the subscription task waits, so order is kept
            try:
                await process(raw)
            finally:
                self._inflight -= 1
                slots.release()
            return
        task = asyncio.get_running_loop().create_task(self._run_one(process, raw))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)

    async def _run_one(self, process: Callable[[Msg], Awaitable[None]], raw: Msg) -> None:
        try:
            await process(raw)
        finally:
            self._inflight -= 1
            self._slots.release()

    @property
    def inflight(self) -> int:
        """Messages being handled right now."""
        return self._inflight

    # --- lifecycle (called by the service runtime) --------------------------------------
    async def start(self, bus: Bus, *, on_escalate: EscalateCallback | None = None) -> None:
        self._bus = bus
        self._on_escalate = on_escalate
        metrics.INFLIGHT.labels(bus.service, self.name).set_function(lambda: self._inflight)
        await self.on_start()
        self.accepting = True
        log.info("actor started", actor=self.name, subscriptions=[s.subject for s in self._subs])

    async def stop(self, timeout_s: float = 10.0) -> bool:
        """Drain: stop receiving, finish received messages within `timeout_s`, then stop tasks.

        Returns True when everything received was handled in time. `abort()` cuts it short.
        """
        self.accepting = False
        subs = list(self._subs)
        finish = asyncio.ensure_future(self._finish(subs))
        forced = asyncio.ensure_future(self._forced.wait())
        done, _ = await asyncio.wait({finish, forced}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        clean = finish in done
        if not clean:
            log.warning("actor drain cut short; abandoning in-flight work", actor=self.name, inflight=self._inflight)
            finish.cancel()
            self._abort_now(subs)
            await asyncio.gather(finish, return_exceptions=True)
        self._subs.clear()
        for task in self._background.values():
            task.cancel()
        await asyncio.gather(*self._background.values(), *self._handler_tasks, return_exceptions=True)
        self._background.clear()
        try:
            await self.on_stop()
        except Exception:
            log.exception("actor on_stop failed", actor=self.name)
        log.info("actor stopped", actor=self.name, clean=clean)
        return clean

    def abort(self) -> None:
        """Stop now: drop received messages, cancel handlers in progress (a forced shutdown)."""
        self._forced.set()
        self._abort_now(self._subs)

    def _abort_now(self, subs: list[Subscription]) -> None:
        self.accepting = False
        for sub in subs:
            sub.abort()
        for task in list(self._handler_tasks):
            task.cancel()

    async def _finish(self, subs: list[Subscription]) -> None:
        await asyncio.gather(*(sub.drain() for sub in subs))
        while self._handler_tasks:
            await asyncio.gather(*list(self._handler_tasks), return_exceptions=True)

    async def _supervise(self, name: str, factory: Callable[[], Awaitable[None]], policy: RestartPolicy) -> None:
        loop = asyncio.get_running_loop()
        crashes: collections.deque[float] = collections.deque()
        backoff = policy.initial_backoff_s
        while True:
            started = loop.time()
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = loop.time()
                log.exception("background task crashed", actor=self.name, task=name)
                if now - started >= policy.window_s:
                    backoff = policy.initial_backoff_s  # it had been healthy: start the backoff over
                crashes.append(now)
                while crashes and now - crashes[0] > policy.window_s:
                    crashes.popleft()
                if not policy.restart or (policy.max_restarts is not None and len(crashes) > policy.max_restarts):
                    log.error("background task escalated", actor=self.name, task=name, crashes=len(crashes))
                    if self._on_escalate is not None:
                        self._on_escalate(self, name, exc)
                    return
                metrics.TASK_RESTARTS.labels(self.bus.service, self.name, name).inc()
                await asyncio.sleep(backoff)
                backoff = min(policy.max_backoff_s, backoff * 2)
