"""Buddy-group frames between worker processes over the data plane (UCX).

One `GroupRouter` per worker: it accepts the transfers keyed `grp:<instance>:...` (the
destination member) at activation priority — the express lane: hidden states, logits,
remote attention — and at KV priority (the exchange, chunked and preempted by the
activations at chunk boundaries by the link's scheduler). Each member (an instance) has a
`PlaneTransport`: `send` is called on the engine thread and queued to one sender task per
peer (FIFO per class); `call_attention` blocks the engine thread until the reply is back.

Inbound frames go to the member's engine thread (`ModelInstance.deliver_group_frame`),
except remote attention: it is served on a thread of its own, so two members calling each
other's attention at once cannot deadlock (it touches only the victims' KV of layers the
member dropped, see `stage_executor.AttentionHolder`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.logging import get_logger

from .wire import AttnCall, AttnReply, Frame, KvExchange, decode, encode, spec

if TYPE_CHECKING:
    from services.gpu_worker.dataplane import WorkerDataPlane
    from services.gpu_worker.instance import ModelInstance

log = get_logger("tidal.gpu_worker.group")
PREFIX = "grp:"
ATTENTION_TIMEOUT_S = 30.0


EARLY_FRAMES = 4096  # frames for an instance that has not joined yet (its JoinGroup is on its way)
# Fault injection for tests: every inbound KvExchange is dropped as if its transfer failed its
# checksum (the owner resends, then falls back to re-prefill). Never set it in production.
FAULT_DROP_GROUP_KV = "TIDAL_FAULT_DROP_GROUP_KV"


class GroupRouter:
    def __init__(self, dataplane: "WorkerDataPlane", local: Callable[[str], bool] = lambda _i: False) -> None:
        self.dataplane = dataplane
        self.local = local  # is this an instance of this worker (a member to be)?
        self.members: dict[str, tuple["ModelInstance", "PlaneTransport"]] = {}  # instance id -> member
        # Members join one by one: a member that joined first may send before this one has.
        self._early: dict[str, list[tuple[Frame, list[torch.Tensor]]]] = {}
        self._attention = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remote-attention")
        self._installed = False
        self._ids = itertools.count()
        self.drop_kv = os.environ.get(FAULT_DROP_GROUP_KV, "0") not in ("", "0")
        if self.drop_kv:
            log.warning("FAULT INJECTION: every inbound KV exchange is dropped", env=FAULT_DROP_GROUP_KV)

    def install(self) -> None:
        """Accept group transfers on this worker's data plane (once it is up)."""
        plane = self.dataplane.plane
        if plane is None:
            raise RuntimeError(self.dataplane.unavailable or "no data plane")
        if self._installed:
            return
        from services.gpu_worker.transfer import Sink, TrafficClass

        def factory(start: Any, _peer: str) -> Any:
            if not start.key.startswith(PREFIX):
                return None
            instance = start.key.split(":")[1]
            if instance not in self.members and not self.local(instance):
                return None  # not ours (a KV migration expects its keys): refused as before
            sink = Sink(start.key, np.empty(start.total_bytes, dtype=np.uint8))
            sink._done.add_done_callback(self._landed)
            return sink

        plane.inbox.on_kind(TrafficClass.ACTIVATION, factory)
        plane.inbox.on_kind(TrafficClass.KV, factory)
        self._installed = True

    def transport(self, instance: "ModelInstance", workers: dict[str, str]) -> "PlaneTransport":
        """The transport of member `instance`; `workers`: every member's instance id -> worker id."""
        t = PlaneTransport(self, instance.instance_id, workers, asyncio.get_running_loop())
        self.members[instance.instance_id] = (instance, t)
        return t

    def activate(self, instance_id: str) -> None:
        """The member has joined (its engine thread has the group): hand it what came early."""
        for frame, tensors in self._early.pop(instance_id, []):
            self._dispatch(instance_id, frame, tensors)

    def forget(self, instance_id: str) -> None:
        entry = self.members.pop(instance_id, None)
        self._early.pop(instance_id, None)
        if entry is not None:
            entry[1].close()

    def next_key(self, to_instance: str) -> str:
        return f"{PREFIX}{to_instance}:{next(self._ids)}"

    def _landed(self, fut: "asyncio.Future[Any]") -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        received = fut.result()
        instance_id = received.key.split(":")[1]
        try:
            frame, tensors = decode(received.buffers)
        except (ValueError, Exception) as exc:  # noqa: BLE001 - a malformed frame is dropped, loudly
            log.error("malformed group frame dropped", key=received.key, peer=received.peer, error=repr(exc))
            return
        if self.drop_kv and isinstance(frame, KvExchange):
            log.warning("FAULT INJECTION: KV exchange dropped", key=received.key, layer=frame.layer)
            return
        member = self.members.get(instance_id)
        if member is None or member[0].group is None:
            early = self._early.setdefault(instance_id, [])
            if len(early) < EARLY_FRAMES:
                early.append((frame, tensors))
            else:
                log.error("group frame for an instance that never joined dropped", instance=instance_id)
            return
        self._dispatch(instance_id, frame, tensors)

    def _dispatch(self, instance_id: str, frame: Frame, tensors: list[torch.Tensor]) -> None:
        instance, transport = self.members[instance_id]
        group = getattr(frame, "group_id", None)  # (a remote attention's reply names none)
        if group is not None and instance.group is not None and group != instance.group.group_id:
            # a group this member is no longer (or never was) in: its micro-batch ids would collide
            log.warning("frame of another group dropped", instance=instance_id, group=group,
                        frame=type(frame).__name__)
            return
        if isinstance(frame, AttnReply):
            transport.resolve(frame, tensors)
        elif isinstance(frame, AttnCall):
            asyncio.get_running_loop().run_in_executor(self._attention, transport.serve, instance, frame, tensors)
        else:
            instance.deliver_group_frame(frame, tensors)

    def close(self) -> None:
        for instance_id in list(self.members):
            self.forget(instance_id)
        self._attention.shutdown(wait=False, cancel_futures=True)


class PlaneTransport:
    """One member's side of the group channel (see the module doc)."""

    def __init__(self, router: GroupRouter, me: str, workers: dict[str, str], loop: asyncio.AbstractEventLoop) -> None:
        self.router, self.me, self.workers, self.loop = router, me, dict(workers), loop
        self._queues: dict[str, asyncio.Queue[tuple[str, bytes, bool]]] = {}
        self._senders: list[asyncio.Task[None]] = []
        self._replies: dict[int, concurrent.futures.Future[torch.Tensor]] = {}
        self._callee: dict[int, str] = {}  # call id -> the member asked
        self.sent_bytes = {"activation": 0, "kv": 0}

    # --- engine thread ---------------------------------------------------------------------
    def send(self, peer: str, frame: Frame, tensors: list[torch.Tensor], *, kv: bool = False) -> None:
        data = encode(frame, tensors)
        self.loop.call_soon_threadsafe(self._enqueue, peer, data, kv)

    def call_attention(self, peer: str, call: AttnCall, tensors: list[torch.Tensor]) -> torch.Tensor:
        from .member import PeerLost

        fut: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        self._replies[call.call_id] = fut
        self._callee[call.call_id] = peer
        self.send(peer, call, tensors)
        try:
            return fut.result(ATTENTION_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as exc:
            raise PeerLost(f"remote attention on {peer}: no answer ({type(exc).__name__})") from exc
        finally:
            self._replies.pop(call.call_id, None)
            self._callee.pop(call.call_id, None)

    def fail_peer(self, peer: str) -> None:
        """`peer` is gone: calls waiting on it end now (the engine thread gets PeerLost)."""
        for call_id, callee in list(self._callee.items()):
            fut = self._replies.get(call_id)
            if callee == peer and fut is not None:
                fut.cancel()

    # --- event loop ------------------------------------------------------------------------
    def resolve(self, reply: AttnReply, tensors: list[torch.Tensor]) -> None:
        fut = self._replies.get(reply.call_id)
        if fut is None or fut.done():
            return
        if reply.error or not tensors:
            fut.set_exception(RuntimeError(f"remote attention failed: {reply.error or 'no output'}"))
        else:
            fut.set_result(tensors[0])

    def serve(self, instance: "ModelInstance", call: AttnCall, tensors: list[torch.Tensor]) -> None:
        """On the attention thread: run it, answer the caller (the member that sent it)."""
        assert instance.group is not None
        try:
            out = instance.group.serve_attention(call, tensors)
            reply, parts = AttnReply(call_id=call.call_id, out=spec(out)), [out]
        except Exception as exc:  # noqa: BLE001 - the caller raises it on its engine thread
            log.warning("remote attention failed", layer=call.layer, error=repr(exc))
            reply, parts = AttnReply(call_id=call.call_id, error=repr(exc)[:2000]), []
        self.send(call.caller, reply, parts)

    def _enqueue(self, peer: str, data: bytes, kv: bool) -> None:
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = asyncio.Queue()
            self._senders.append(asyncio.ensure_future(self._sender(peer, queue)))
        queue.put_nowait((self.router.next_key(peer), data, kv))

    async def _sender(self, peer: str, queue: "asyncio.Queue[tuple[str, bytes, bool]]") -> None:
        from services.gpu_worker.transfer import TrafficClass, TransferFailed

        worker = self.workers[peer]
        while True:
            key, data, kv = await queue.get()
            try:
                plane = self.router.dataplane.plane
                link = await plane.link(worker)
                kind = TrafficClass.KV if kv else TrafficClass.ACTIVATION
                handle = await link.submit(np.frombuffer(data, dtype=np.uint8), kind=kind, key=key)
                self.sent_bytes["kv" if kv else "activation"] += len(data)
                acked = asyncio.ensure_future(handle.wait())
                acked.add_done_callback(lambda f, k=key: f.cancelled() or f.exception() is None or log.error(
                    "group frame not delivered", key=k, peer=peer, error=repr(f.exception())))
            except (TransferFailed, AttributeError) as exc:
                log.error("group frame not sent", key=key, peer=peer, error=repr(exc))

    def close(self) -> None:
        for task in self._senders:
            task.cancel()
        for fut in self._replies.values():
            fut.cancel()
