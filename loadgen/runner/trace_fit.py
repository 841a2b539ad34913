"""Does a trace fit the cluster it is about to be sent to? Checked before anything is sent. Pure.

A trace names models (and adapters); the gateway serves others, each with a context. A
trace made for another cluster — or with another cluster config — would fail every request
with 404, so `tidal bench serve` refuses it up front, names what is missing, lists what is
served and how to map one onto the other (`--model-map OLD=NEW`, applied at load by
`map_models`). Records longer than their model's context are not refused: the payload maker
shortens them to fit (`payloads.py`), and `length_notes` says how many and by how much.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from loadgen.traces.schema import TraceRecord


class TraceMismatch(ValueError):
    """The trace names models or adapters the gateway does not serve."""


def parse_model_map(pairs: Iterable[str]) -> dict[str, str]:
    """`["old=new", ...]` (the repeatable --model-map) -> {old: new}."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        old, new = old.strip(), new.strip()
        if not sep or not old or not new:
            raise ValueError(f"--model-map {pair!r}: expected OLD=NEW, e.g. model-0=demo-llama")
        if old in mapping and mapping[old] != new:
            raise ValueError(f"--model-map maps {old!r} twice ({mapping[old]!r} and {new!r})")
        mapping[old] = new
    return mapping


def map_models(records: Sequence[TraceRecord], mapping: Mapping[str, str]) -> list[TraceRecord]:
    """The records with their model and adapter names renamed by `mapping` (others unchanged)."""
    if not mapping:
        return list(records)
    out = []
    for rec in records:
        model = mapping.get(rec.model, rec.model)
        adapter = mapping.get(rec.adapter, rec.adapter) if rec.adapter is not None else None
        out.append(rec if (model, adapter) == (rec.model, rec.adapter)
                   else msgspec.structs.replace(rec, model=model, adapter=adapter))
    return out


def check_served(records: Sequence[TraceRecord], served: Sequence[str], url: str) -> None:
    """Raise TraceMismatch unless every name the records send is in `served` (the gateway's list)."""
    wanted = Counter(r.adapter or r.model for r in records)
    missing = sorted((name for name in wanted if name not in set(served)), key=lambda n: (-wanted[n], n))
    if not missing:
        return
    shown = ", ".join(f"{name} ({wanted[name]} requests)" for name in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    listing = ", ".join(served) if served else "nothing (is a worker up?)"
    example = " ".join(f"--model-map {name}={served[0]}" for name in missing[:2]) if served else "--model-map OLD=NEW"
    raise TraceMismatch(
        f"the trace names models the gateway at {url} does not serve: {shown}{more}. It serves: {listing}. "
        f"Nothing was sent. Map the trace's models to served ones with --model-map OLD=NEW (repeatable), "
        f"e.g. {example}; or make the trace with `tidal trace ... --config` of this cluster.")


def length_notes(records: Sequence[TraceRecord], context: Mapping[str, int]) -> list[str]:
    """One line per model whose requests do not fit its context (prompt + output tokens)."""
    notes = []
    for model in sorted({r.model for r in records}):
        limit = context.get(model)
        if limit is None:
            continue
        mine = [r for r in records if r.model == model]
        over = [r.prompt_tokens + r.output_tokens for r in mine if r.prompt_tokens + r.output_tokens > limit]
        if over:
            notes.append(f"{len(over)} of {len(mine)} requests to {model} need more than its {limit}-token context "
                         f"(prompt + output, up to {max(over)}): they are shortened to fit and counted as clamped")
    return notes


__all__ = ["TraceMismatch", "check_served", "length_notes", "map_models", "parse_model_map"]
