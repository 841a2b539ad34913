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

import math
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


def _slack(left: float, budget: float) -> float:
    """The share of a bin's budget left after a move (an unlimited bin is never the tight one)."""
    if math.isinf(budget):
        return 1.0
    return left / budget if budget else 0.0


def choose_migration_modes(candidates: Iterable[MigrationCandidate],
                           link_budget_bytes: Mapping[tuple[str, str], float],
                           prefill_budget_tokens: Mapping[str, float],
                           setting: MigrationSetting = "auto", *,
                           egress_budget_bytes: Mapping[str, float] | None = None,
                           ingress_budget_bytes: Mapping[str, float] | None = None) -> list[MigrationChoice]:
    """Pack all of an interval's moves into link byte budgets (kv) and destination prefill
    budgets (tokens); what fits neither is deferred. `egress_budget_bytes` / `ingress_budget_bytes`
    (optional, per device): a KV move must also fit its source's outgoing and its destination's
    incoming bytes (one network interface per device shared by all its links); a device missing
    from a given map has budget 0."""
    cands = list(candidates)
    _check(cands, link_budget_bytes, prefill_budget_tokens, setting)
    for name, budgets in (("egress", egress_budget_bytes), ("ingress", ingress_budget_bytes)):
        for dev, b in (budgets or {}).items():
            if b < 0:
                raise ValueError(f"{name} budget for {dev!r} is negative: {b}")
    link_left = {k: float(v) for k, v in link_budget_bytes.items()}
    prefill_left = {k: float(v) for k, v in prefill_budget_tokens.items()}
    out_left = None if egress_budget_bytes is None else {k: float(v) for k, v in egress_budget_bytes.items()}
    in_left = None if ingress_budget_bytes is None else {k: float(v) for k, v in ingress_budget_bytes.items()}
    mode_of: dict[str, MigrationMode] = {}
    for c in sorted(cands, key=lambda c: (-c.kv_bytes, -c.tokens, c.request_id)):
        link = (c.source, c.destination)
        kv_left = link_left.get(link, 0.0) - c.kv_bytes
        slacks = [_slack(kv_left, link_budget_bytes.get(link, 0.0))]
        nic_ok = True
        if out_left is not None:
            o = out_left.get(c.source, 0.0) - c.kv_bytes
            nic_ok = o >= 0
            slacks.append(_slack(o, egress_budget_bytes[c.source] if c.source in egress_budget_bytes else 0.0))
        if in_left is not None:
            i = in_left.get(c.destination, 0.0) - c.kv_bytes
            nic_ok = nic_ok and i >= 0
            slacks.append(_slack(i, ingress_budget_bytes.get(c.destination, 0.0)))
        tok_left = prefill_left.get(c.destination, 0.0) - c.tokens
        kv_ok = setting in ("auto", "kv") and kv_left >= 0 and nic_ok
        tok_ok = setting in ("auto", "tokens") and tok_left >= 0
        if kv_ok and tok_ok:  # best fit: the bin this move fills the most, relative to its size
            kv_slack = min(slacks)
            tok_slack = _slack(tok_left, prefill_budget_tokens[c.destination])
            tok_ok = tok_slack < kv_slack
            kv_ok = not tok_ok
        if kv_ok:
            link_left[link] = kv_left
            if out_left is not None:
                out_left[c.source] = out_left.get(c.source, 0.0) - c.kv_bytes
            if in_left is not None:
                in_left[c.destination] = in_left.get(c.destination, 0.0) - c.kv_bytes
            mode_of[c.request_id] = "kv"
        elif tok_ok:
            prefill_left[c.destination] = tok_left
            mode_of[c.request_id] = "tokens"
        else:
            mode_of[c.request_id] = "defer"
    return [MigrationChoice(c.request_id, c.source, c.destination, mode_of[c.request_id]) for c in cands]
