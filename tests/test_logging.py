"""Logs are JSON, carry the request context, and never leak a frame's locals."""
from __future__ import annotations

import io
import json

from shared.logging import configure_logging, get_logger


def _fail_with_secret() -> None:
    api_key = "sk-very-secret-key"  # a local that must never reach a log line
    raise ValueError(f"bad thing happened ({len(api_key)} chars)")


def test_exception_log_is_json_with_traceback_but_no_locals():
    out = io.StringIO()
    configure_logging(level="INFO", stream=out)
    log = get_logger("test")
    try:
        _fail_with_secret()
    except ValueError:
        log.exception("handler failed", request_id="req-1")
    line = out.getvalue().strip().splitlines()[-1]
    record = json.loads(line)
    assert record["event"] == "handler failed"
    assert record["request_id"] == "req-1"
    assert "ValueError" in json.dumps(record["exception"])
    assert "_fail_with_secret" in json.dumps(record["exception"])  # the frames are there
    assert "sk-very-secret-key" not in line  # their locals are not
