"""MELL operations and results (Fig. 10 / Algorithm 1), and §VI's removal of redundant moves.

`coalesce_moves` is what request-operation batching adds over executing the operations one
by one: a request moved A->B then B->C moves once, A->C; A->B->A does not move; a request that
departs in the batch, or was first placed in the batch, is not moved at all (a newly placed
request simply starts on its final device).
"""
from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Allocate:
    request_id: str
    size: int


@dataclass(frozen=True, slots=True)
class Depart:
    request_id: str


@dataclass(frozen=True, slots=True)
class Update:
    request_id: str
    size: int  # the request's new (grown) KV size


Op = Allocate | Depart | Update


@dataclass(frozen=True, slots=True)
class Move:
    request_id: str
    source: str
    destination: str


@dataclass(frozen=True, slots=True)
class OpResult:
    placements: dict[str, str]  # request_id -> device, for requests this op allocated
    moves: tuple[Move, ...]  # migrations of running requests this op caused (<= max_migrations_per_op)


@dataclass(frozen=True, slots=True)
class BatchResult:
    placements: dict[str, str]
    moves: tuple[Move, ...]  # after removing redundant moves
    moves_before_dedup: int  # what executing the ops one by one would have moved (batching ablation)


class NoCapacity(RuntimeError):
    """Every allowed device is active and the request fits on none of them."""


def coalesce_moves(moves: Iterable[Move], skip: Set[str] = frozenset()) -> tuple[Move, ...]:
    """One move per request, first source -> last destination, in order of first appearance;
    requests in `skip` (departed or placed within the batch) and round trips vanish."""
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    for move in moves:
        if move.request_id in skip:
            continue
        first.setdefault(move.request_id, move.source)
        last[move.request_id] = move.destination
    return tuple(Move(rid, src, last[rid]) for rid, src in first.items() if src != last[rid])
