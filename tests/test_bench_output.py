"""Where benchmarks write (tidal/bench/output.py): under runs/ by default, docs/images only with
--update-docs. The real CLI parser, no benchmark run."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from tidal.bench.output import DOC_IMAGES, RUNS, default_out, out_dir, publish_plot
from tidal.cli import build_parser

# Every bench that writes files, with the image of it the docs show (None: no docs figure).
WRITERS = {"engine": "engine_decode_step.png", "migrate": "migrate_downtime.png", "serve": None, "fidelity": None}
NOW = time.mktime((2025, 3, 4, 5, 6, 7, 0, 0, -1))


def parse(bench: str, *extra: str):  # type: ignore[no-untyped-def]
    argv = ["bench", bench, *extra]
    if bench == "serve":
        argv.append("trace.jsonl")
    return build_parser().parse_args(argv)


def docs_images_digest() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(DOC_IMAGES.glob("*"))}


@pytest.mark.parametrize("bench", sorted(WRITERS))
def test_a_bench_writes_under_runs_by_default_and_under_out_when_given(bench: str, tmp_path: Path) -> None:
    args = parse(bench)
    assert out_dir(args, NOW) == Path.cwd() / RUNS / f"{bench}-20250304-050607" == default_out(bench, NOW)
    # under the directory it runs in, and absolute: a config written there must not resolve it again
    assert RUNS == Path("runs") and out_dir(args, NOW).is_absolute()
    assert out_dir(parse(bench, "--out", str(tmp_path / "x")), NOW) == tmp_path / "x"


@pytest.mark.parametrize("bench", ["engine", "migrate"])
def test_docs_images_change_only_with_update_docs(bench: str, tmp_path: Path) -> None:
    png = tmp_path / "run" / WRITERS[bench]  # type: ignore[operator]
    png.parent.mkdir()
    png.write_bytes(b"\x89PNG new figure")
    before = docs_images_digest()
    args = parse(bench, "--out", str(png.parent))
    assert not args.update_docs and publish_plot(args, png) is None
    assert docs_images_digest() == before and WRITERS[bench] in before  # the tracked figure, untouched

    images = tmp_path / "images"  # with the flag, the copy goes where the docs' images are
    published = publish_plot(parse(bench, "--update-docs"), png, images=images)
    assert published == images / WRITERS[bench] and published.read_bytes() == png.read_bytes()  # type: ignore[operator]
    assert docs_images_digest() == before


def test_update_docs_targets_the_repository_docs() -> None:
    assert DOC_IMAGES == Path(__file__).resolve().parents[1] / "docs" / "images"
    for bench in ("serve", "fidelity"):  # no docs figure: no flag
        assert not hasattr(parse(bench), "update_docs")
