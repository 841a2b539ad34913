"""The `tidal` entry point: only the chosen subcommand's module is imported, `--help` lists every one with
its own summary, and a reader that goes away (`tidal trace … | head`) ends the command without a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tidal.cli import COMMANDS, build_parser

HEAVY = ("torch", "tidal.bench.engine", "services.gpu_worker.engine", "loadgen.sim")


def choices(parser) -> dict[str, str]:  # type: ignore[no-untyped-def]
    action = next(a for a in parser._subparsers._group_actions)
    return {c.dest: c.help for c in action._choices_actions}


def test_the_summaries_in_help_are_the_ones_the_modules_register() -> None:
    lazy, full = choices(build_parser([])), choices(build_parser())
    assert lazy == full and list(lazy) == [name for name, _help in COMMANDS.values()]


def test_help_and_status_import_no_engine_benchmark_or_simulator(tmp_path: Path) -> None:
    probe = ("import sys\nfrom tidal.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))")
    for argv in (["--help"], ["status", "--state", str(tmp_path)]):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert done.stdout.strip().splitlines()[-1] == "[]", (argv, done.stdout[-2000:], done.stderr[-2000:])


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tidal", "trace", "poisson", "--out", str(tmp_path / "t.jsonl"),
                             "--duration", "30"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TIDAL_STATE": ""})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert (tmp_path / "t.jsonl").stat().st_size > 0  # the work itself was done
