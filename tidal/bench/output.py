"""Where a benchmark's files go: its `--out` directory, by default `runs/<bench>-<timestamp>/`.

A benchmark run leaves the source tree alone: plots and reports land in the run's own
directory (`runs/` is git-ignored), and the images the docs show (docs/images/) are
replaced only when asked, with `--update-docs`, which copies the run's PNG there.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
import shutil
import time
from pathlib import Path

RUNS = Path("runs")
DOC_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


def default_out(bench: str, now: float) -> Path:
    """runs/<bench>-YYYYmmdd-HHMMSS under the cwd for a run started at `now` (Unix seconds, local time);
    absolute, so a config file written inside it never resolves it a second time against itself."""
    return (RUNS / f"{bench}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}").absolute()


def add_out_argument(parser: argparse.ArgumentParser, bench: str, *, doc_image: str | None = None) -> None:
    """--out (and --update-docs when the bench draws an image the docs show)."""
    parser.add_argument("--out", default=None, help=f"directory for this run's files (default: runs/{bench}-<time>)")
    if doc_image is not None:
        parser.add_argument("--update-docs", action="store_true",
                            help=f"also copy the plot to docs/images/{doc_image} (the docs' figure)")
    parser.set_defaults(bench_name=bench, doc_image=doc_image)


def out_dir(args: argparse.Namespace, now: float) -> Path:
    """The run's directory: --out, else the default under runs/ (not created here)."""
    return Path(args.out).absolute() if args.out else default_out(args.bench_name, now)


def publish_plot(args: argparse.Namespace, png: Path, images: Path = DOC_IMAGES) -> Path | None:
    """With --update-docs, copy the run's PNG over the docs' image; returns where it went."""
    if not getattr(args, "update_docs", False) or args.doc_image is None:
        return None
    images.mkdir(parents=True, exist_ok=True)
    target = images / args.doc_image
    shutil.copyfile(png, target)
    return target


__all__ = ["DOC_IMAGES", "RUNS", "add_out_argument", "default_out", "out_dir", "publish_plot"]


def run_alone(register: Callable[[argparse._SubParsersAction], None], name: str, argv: list[str]) -> int:
    """Run one bench without `tidal bench`, which imports every bench (the gateway's needs litestar):
    `python -m tidal.bench.<module> ARGS` on a machine with only that bench's dependencies."""
    parser = argparse.ArgumentParser(prog=name)
    register(parser.add_subparsers())
    args = parser.parse_args([name, *argv])
    return int(args.func(args))
