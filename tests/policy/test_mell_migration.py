"""MELL §V adaptive migration: a global two-bin packing of an interval's moves into per-link byte
budgets (KV transfer) and per-destination prefill-token budgets (token transfer + re-prefill)."""
from __future__ import annotations

import pytest

from shared.policy.mell_migration import MigrationCandidate, MigrationChoice, choose_migration_modes


def cand(rid: str, src: str = "a", dst: str = "b", kv: int = 100, tokens: int = 10) -> MigrationCandidate:
    return MigrationCandidate(rid, src, dst, kv, tokens)


def modes(choices: list[MigrationChoice]) -> dict[str, str]:
    return {c.request_id: c.mode for c in choices}


def test_kv_when_the_link_has_room_tokens_when_only_prefill_has_room_else_defer() -> None:
    links = {("a", "b"): 150.0}
    prefill = {"b": 15.0}
    got = choose_migration_modes([cand("r1", kv=100, tokens=10), cand("r2", kv=90, tokens=10),
                                  cand("r3", kv=80, tokens=10)], links, prefill)
    # r1 (largest first) fits both and would leave a third of either: the tie goes to KV;
    # r2 no longer fits the link (50 left) but fits prefill; r3 fits neither
    assert modes(got) == {"r1": "kv", "r2": "tokens", "r3": "defer"}
    assert [c.request_id for c in got] == ["r1", "r2", "r3"]  # the candidates' order


def test_the_packing_is_global_across_sources_sharing_a_destination() -> None:
    # two sources migrate to d; d's prefill budget takes one re-prefill, not one per source
    cands = [cand("x", "s1", "d", kv=500, tokens=40), cand("y", "s2", "d", kv=500, tokens=40)]
    got = choose_migration_modes(cands, {("s1", "d"): 100.0, ("s2", "d"): 100.0}, {"d": 50.0})
    assert sorted(modes(got).values()) == ["defer", "tokens"]


def test_larger_moves_are_packed_first() -> None:
    # the big move goes first and takes the link; processed in input order, the small one would
    got = choose_migration_modes([cand("small", kv=40, tokens=4), cand("big", kv=100, tokens=10)],
                                 {("a", "b"): 100.0}, {"b": 5.0})
    assert modes(got) == {"big": "kv", "small": "tokens"}


def test_best_fit_puts_a_move_where_it_leaves_the_least_room() -> None:
    got = choose_migration_modes([cand("r", kv=100, tokens=10)], {("a", "b"): 1000.0}, {"b": 11.0})
    assert modes(got) == {"r": "tokens"}
    got = choose_migration_modes([cand("r", kv=100, tokens=10)], {("a", "b"): 101.0}, {"b": 1000.0})
    assert modes(got) == {"r": "kv"}


def test_forced_modes_and_off() -> None:
    cands = [cand("r1", kv=100, tokens=10), cand("r2", kv=100, tokens=10)]
    links, prefill = {("a", "b"): 150.0}, {"b": 1000.0}
    assert modes(choose_migration_modes(cands, links, prefill, "kv")) == {"r1": "kv", "r2": "defer"}
    assert modes(choose_migration_modes(cands, links, prefill, "tokens")) == {"r1": "tokens", "r2": "tokens"}
    assert modes(choose_migration_modes(cands, links, prefill, "off")) == {"r1": "defer", "r2": "defer"}


def test_unknown_links_and_destinations_have_no_budget() -> None:
    assert modes(choose_migration_modes([cand("r")], {}, {})) == {"r": "defer"}


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="setting must be one of"):
        choose_migration_modes([], {}, {}, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'r' has negative size"):
        choose_migration_modes([cand("r", kv=-1)], {}, {})
    with pytest.raises(ValueError, match="'r' appears twice"):
        choose_migration_modes([cand("r"), cand("r")], {}, {})
    with pytest.raises(ValueError, match="negative"):
        choose_migration_modes([], {("a", "b"): -1.0}, {})
