"""schemas/ and compose/nats.conf are generated from the code; this fails when they are stale."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared import events, schemas_gen, subjects
from tidal.commands import schemas as schemas_command

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"
NATS_CONF = ROOT / "compose" / "nats.conf"


def tidal_main(argv: list[str]) -> int:
    """`tidal <argv>` with only the schemas subcommand registered (the real CLI runs in a subprocess below)."""
    parser = argparse.ArgumentParser(prog="tidal")
    schemas_command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_committed_schemas_match_the_code():
    problems = schemas_gen.stale(SCHEMAS, NATS_CONF)
    assert problems == [], "stale generated files (run `tidal schemas`):\n" + "\n".join(problems)


def test_descriptions_are_dedented_whatever_msgspec_does():
    """msgspec 0.22 copies a docstring raw, 0.23 dedents it: the committed files must not depend on which."""
    schema = schemas_gen.message_schema(events.AbortRequest)
    description = schema["$defs"]["AbortRequest"]["description"]
    assert "\n\n" in description  # a multi-paragraph docstring, so there was indentation to remove
    assert not any(line.startswith(" ") for line in description.splitlines())


def test_generation_is_deterministic_across_processes():
    """Set iteration order changes with the hash seed; the output must not."""
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-m", "tidal", "schemas", "--check"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


@pytest.fixture
def copy(tmp_path):
    """A copy of the committed schemas/ and nats.conf to break."""
    shutil.copytree(SCHEMAS, tmp_path / "schemas")
    shutil.copy(NATS_CONF, tmp_path / "nats.conf")
    return tmp_path


def _check(copy: Path) -> int:
    return tidal_main(["schemas", "--check", "--out", str(copy / "schemas"), "--nats-conf", str(copy / "nats.conf")])


def test_check_passes_on_fresh_output_and_names_every_stale_file(copy, capsys):
    assert _check(copy) == 0
    chunk = copy / "schemas" / "messages" / "TokenChunk.json"
    chunk.write_text(chunk.read_text().replace("token_chunk", "token_chunk_v0"))
    (copy / "schemas" / "messages" / "Assignment.json").unlink()
    (copy / "schemas" / "messages" / "RemovedLongAgo.json").write_text("{}\n")
    (copy / "nats.conf").write_text((copy / "nats.conf").read_text().replace('"tidal.v1.dispatch.submit"', '">"'))
    capsys.readouterr()
    assert _check(copy) == 1
    err = capsys.readouterr().err
    assert "TokenChunk.json: out of date" in err
    assert "Assignment.json: missing" in err
    assert "RemovedLongAgo.json: no longer generated" in err
    assert "nats.conf: out of date" in err
    assert "4 file(s) differ" in err


def test_write_repairs_what_check_found(copy):
    (copy / "schemas" / "SUBJECTS.md").write_text("hand edited\n")
    (copy / "schemas" / "messages" / "RemovedLongAgo.json").write_text("{}\n")
    assert tidal_main(["schemas", "--out", str(copy / "schemas"), "--nats-conf", str(copy / "nats.conf")]) == 0
    assert not (copy / "schemas" / "messages" / "RemovedLongAgo.json").exists()
    assert _check(copy) == 0


def test_every_message_has_a_schema_with_its_tag_and_subjects():
    for cls in events.all_messages():
        schema = json.loads((SCHEMAS / "messages" / f"{cls.__name__}.json").read_text())
        body = schema["$defs"][cls.__name__]
        assert body["properties"]["type"] == {"enum": [events.message_tag(cls)]}
        assert "type" in body["required"]
        assert schema["x-tidal"]["tag"] == events.message_tag(cls)
    submit = json.loads((SCHEMAS / "messages" / "SubmitRequest.json").read_text())
    assert submit["x-tidal"]["subjects"] == ["tidal.v1.dispatch.submit"]
    request_id = submit["$defs"]["SubmitRequest"]["properties"]["request_id"]
    assert request_id["maxLength"] == 64  # bounds reach the published contract


def test_subject_catalog_files_list_every_subject():
    catalog = json.loads((SCHEMAS / "subjects.json").read_text())
    assert {e["subject"] for e in catalog["subjects"]} == {s.template for s in subjects.CATALOG.values()}
    submit = next(e for e in catalog["subjects"] if e["key"] == "dispatch.submit")
    assert submit["reply"] == ["SubmitAccepted", "SubmitRejected", "ErrorReply"]
    assert submit["queue_group"] == "dispatcher" and submit["publishers"] == ["gateway"]
    markdown = (SCHEMAS / "SUBJECTS.md").read_text()
    for spec in subjects.CATALOG.values():
        row = next(line for line in markdown.splitlines() if line.startswith(f"| `{spec.template}` |"))
        assert row.count(" | ") == 6, row  # 7 columns: no stray '|' inside a cell
        assert all(role in row for role in spec.publishers | spec.listeners)


def test_config_schema_accepts_units():
    schema = json.loads((SCHEMAS / "cluster-config.schema.json").read_text())
    memory = schema["$defs"]["WorkerSpec"]["properties"]["memory"]
    assert {"type": "integer", "minimum": 0} in memory["anyOf"]
    assert "unknown" not in json.dumps(schema)
    assert schema["$defs"]["GatewaySection"]["additionalProperties"] is False  # unknown keys refused
