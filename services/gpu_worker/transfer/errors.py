"""Typed failures of a transfer: every way one can end badly has a reason a caller can act on.

Live migration (issue 6, Phase 2) falls back to token mode on `corrupt`/`truncated`, keeps
the request on the source on `peer_lost`, and so on; nothing is signalled by a bare
exception text.
"""
from __future__ import annotations

from typing import Literal

FailureReason = Literal[
    "corrupt",  # a chunk's checksum did not match what was received
    "truncated",  # a chunk arrived with more or fewer bytes than its header announced
    "peer_lost",  # the connection to the peer broke (process died, network gone)
    "unreachable",  # no connection could be opened (no address, nothing listening)
    "cancelled",  # the sender cancelled it
    "rejected",  # the receiver had no destination for it (nobody expected the key)
    "timeout",  # no acknowledgement within the caller's deadline
    "protocol",  # a malformed or out-of-order frame
    "closed",  # the local data plane was shut down
]

FAILURE_REASONS: tuple[str, ...] = FailureReason.__args__  # type: ignore[attr-defined]


class TransferFailed(Exception):
    """A transfer did not complete; `reason` says why (see FailureReason)."""

    def __init__(self, reason: FailureReason, message: str = "", *, transfer_id: int | None = None,
                 peer: str | None = None) -> None:
        self.reason: FailureReason = reason
        self.transfer_id = transfer_id
        self.peer = peer
        where = f" (transfer {transfer_id}" + (f", peer {peer})" if peer else ")") if transfer_id is not None else ""
        super().__init__(f"{reason}{where}: {message}" if message else f"{reason}{where}")
