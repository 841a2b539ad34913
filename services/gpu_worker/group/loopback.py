"""Members of a buddy group in one process, joined by an in-memory channel (tests, benchmark).

Every frame goes through the real wire format (`wire.encode`/`decode`). Activation frames
are delivered in order; KV frames wait in their own queue and the driver lets through
`kv_per_round` of them per round, standing in for a slower bulk transfer that activations
overtake. Remote attention is served at once by the callee (the data plane's express lane).
"""
from __future__ import annotations

from collections import Counter, deque

import torch

from services.gpu_worker.engine.outputs import RequestOutput

from .member import GroupMember
from .wire import AttnCall, AttnReply, Frame, decode, encode, spec


class Loopback:
    def __init__(self) -> None:
        self.members: dict[str, GroupMember] = {}
        self._activations: dict[str, deque[bytes]] = {}
        self._kv: dict[str, deque[bytes]] = {}
        self.sent: Counter[str] = Counter()  # frame type -> count
        self.kv_bytes = 0

    def port(self, member_id: str) -> "_Port":
        self._activations.setdefault(member_id, deque())
        self._kv.setdefault(member_id, deque())
        return _Port(self)

    def add(self, member: GroupMember) -> GroupMember:
        self.members[member.member_id] = member
        return member

    def kv_queued(self, member_id: str) -> int:
        return len(self._kv[member_id])

    def deliver(self, member_id: str, *, kv_per_round: int = 1) -> list[RequestOutput]:
        """Hand `member_id` its queued activation frames and up to `kv_per_round` KV frames."""
        member = self.members[member_id]
        outputs: list[RequestOutput] = []
        kv = self._kv[member_id]
        for _ in range(min(kv_per_round, len(kv))):
            outputs += member.handle(*decode(kv.popleft()))
        queue = self._activations[member_id]
        while queue:
            outputs += member.handle(*decode(queue.popleft()))
        return outputs


class _Port:
    def __init__(self, loop: Loopback) -> None:
        self.loop = loop

    def send(self, peer: str, frame: Frame, tensors: list[torch.Tensor], *, kv: bool = False) -> None:
        data = encode(frame, tensors)
        self.loop.sent[type(frame).__name__] += 1
        if kv:
            self.loop.kv_bytes += len(data)
        (self.loop._kv if kv else self.loop._activations)[peer].append(data)

    def call_attention(self, peer: str, call: AttnCall, tensors: list[torch.Tensor]) -> torch.Tensor:
        self.loop.sent["AttnCall"] += 1
        frame, inputs = decode(encode(call, tensors))
        assert isinstance(frame, AttnCall)
        out = self.loop.members[peer].serve_attention(frame, inputs)
        reply, outputs = decode(encode(AttnReply(call_id=call.call_id, out=spec(out)), [out]))
        assert isinstance(reply, AttnReply)
        return outputs[0]
