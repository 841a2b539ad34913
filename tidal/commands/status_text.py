"""Text helpers of `tidal status`'s views: sizes, ages, and ids wrapped only at their dashes."""
from __future__ import annotations

import re

from rich.text import Text


def human_bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def dash_wrap(name: str, width: int) -> Text:
    """`name` broken only after a '-' or '_' (ids like gpu_worker-w0-3f9a1c-r1) into lines of at most `width`;
    a piece longer than a line is cut, as there is no better place."""
    lines: list[str] = []
    line = ""
    for piece in re.findall(r"[^-_]*[-_]|[^-_]+$", name):
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        while len(piece) > width > 0:
            lines.append(piece[:width])
            piece = piece[width:]
        line += piece
    lines.append(line)
    return Text("\n".join(lines))
