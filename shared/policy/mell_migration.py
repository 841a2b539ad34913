"""MELL §V adaptive request migration: KV transfer or token transfer + re-prefill, per move.

Every move planned in an interval is packed, all together (the paper's *global consensus*: a
link or a destination shared by several sources is charged once for all of them), into two
kinds of bins: the byte budget of its (source, destination) link -- the communication
boundary -- if it goes as KV, or the prefill-token budget of its destination -- the
computation boundary -- if it goes as tokens and is re-prefilled there. Greedy best-fit with
the larger moves first (by KV bytes, then tokens): a move that fits both goes where it leaves
the smaller fraction of that bin's budget unused (ties: KV, which costs the destination no
compute); a move that fits neither is deferred to the next interval.

Choices where the paper is silent: a link or destination missing from the budget maps has
budget 0; forced modes ("kv", "tokens") still defer what exceeds that mode's budget; "off"
defers every move. Results come back in the order of the candidates.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

MigrationMode = Literal["kv", "tokens", "defer"]
MigrationSetting = Literal["auto", "kv", "tokens", "off"]
SETTINGS = ("auto", "kv", "tokens", "off")


@dataclass(frozen=True, slots=True)
class MigrationCandidate:
    request_id: str
    source: str
    destination: str
    kv_bytes: int
    tokens: int


@dataclass(frozen=True, slots=True)
class MigrationChoice:
    request_id: str
    source: str
    destination: str
    mode: MigrationMode


def _check(candidates: list[MigrationCandidate], link_budget_bytes: Mapping[tuple[str, str], float],
           prefill_budget_tokens: Mapping[str, float], setting: str) -> None:
    if setting not in SETTINGS:
        raise ValueError(f"migration setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    seen: set[str] = set()
    for c in candidates:
        if c.kv_bytes < 0 or c.tokens < 0:
            raise ValueError(f"migration of {c.request_id!r} has negative size (kv_bytes={c.kv_bytes}, "
                             f"tokens={c.tokens})")
        if c.request_id in seen:
            raise ValueError(f"request {c.request_id!r} appears twice among the migration candidates")
        seen.add(c.request_id)
    for link, b in link_budget_bytes.items():
        if b < 0:
            raise ValueError(f"link budget for {link} is negative: {b}")
    for dest, b in prefill_budget_tokens.items():
        if b < 0:
            raise ValueError(f"prefill budget for {dest!r} is negative: {b}")


def choose_migration_modes(candidates: Iterable[MigrationCandidate],
                           link_budget_bytes: Mapping[tuple[str, str], float],
                           prefill_budget_tokens: Mapping[str, float],
                           setting: MigrationSetting = "auto") -> list[MigrationChoice]:
    """Pack all of an interval's moves into link byte budgets (kv) and destination prefill
    budgets (tokens); what fits neither is deferred."""
    cands = list(candidates)
    _check(cands, link_budget_bytes, prefill_budget_tokens, setting)
    link_left = {k: float(v) for k, v in link_budget_bytes.items()}
    prefill_left = {k: float(v) for k, v in prefill_budget_tokens.items()}
    mode_of: dict[str, MigrationMode] = {}
    for c in sorted(cands, key=lambda c: (-c.kv_bytes, -c.tokens, c.request_id)):
        link = (c.source, c.destination)
        kv_left = link_left.get(link, 0.0) - c.kv_bytes
        tok_left = prefill_left.get(c.destination, 0.0) - c.tokens
        kv_ok = setting in ("auto", "kv") and kv_left >= 0
        tok_ok = setting in ("auto", "tokens") and tok_left >= 0
        if kv_ok and tok_ok:  # best fit: the bin this move fills the most, relative to its size
            kv_slack = kv_left / link_budget_bytes[link] if link_budget_bytes[link] else 0.0
            tok_slack = tok_left / prefill_budget_tokens[c.destination] if prefill_budget_tokens[c.destination] else 0.0
            tok_ok = tok_slack < kv_slack
            kv_ok = not tok_ok
        if kv_ok:
            link_left[link] = kv_left
            mode_of[c.request_id] = "kv"
        elif tok_ok:
            prefill_left[c.destination] = tok_left
            mode_of[c.request_id] = "tokens"
        else:
            mode_of[c.request_id] = "defer"
    return [MigrationChoice(c.request_id, c.source, c.destination, mode_of[c.request_id]) for c in cands]
