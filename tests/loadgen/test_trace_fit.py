"""A trace's models against the cluster's: `tidal trace` names the config's default model, and
`tidal bench serve` maps (--model-map) and checks names and lengths before sending (trace_fit.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.runner.trace_fit import TraceMismatch, check_served, length_notes, map_models, parse_model_map
from loadgen.traces.io import read_trace
from loadgen.traces.schema import TraceRecord
from shared.config import load_config
from tidal.cli import main
from tidal.commands.trace import config_models

URL = "http://127.0.0.1:8000"
CONFIG = """
[[models]]
name = "alpha"
path = "/nowhere/alpha"

[[models]]
name = "beta"
path = "/nowhere/beta"
{workers}
"""
WORKER = '\n[[workers]]\nid = "w0"\ndevice = "cpu"\nmemory = "64MiB"\nmodels = ["beta"]\n'


def rec(model: str, prompt: int = 10, output: int = 5, adapter: str | None = None) -> TraceRecord:
    return TraceRecord(arrival_s=0.0, model=model, prompt_tokens=prompt, output_tokens=output, adapter=adapter)


def test_the_default_trace_model_is_the_config_default_model(tmp_path: Path, capsys) -> None:
    embedded = load_config()
    assert main(["trace", "poisson", "--duration", "20", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert read_trace(tmp_path / "e.jsonl").models() == [config_models(None)[0]]
    assert config_models(None)[0] in {m.name for m in embedded.models}
    assert config_models(None)[0] in {m for w in embedded.workers for m in w.models}  # the cluster serves it

    unserved = tmp_path / "first.toml"  # no workers: the first [[models]] entry
    unserved.write_text(CONFIG.format(workers=""))
    served = tmp_path / "served.toml"  # a worker serves only the second: that one
    served.write_text(CONFIG.format(workers=WORKER))
    for config, want in ((unserved, "alpha"), (served, "beta")):
        for kind in ("poisson", "burstgpt"):
            out = tmp_path / f"{kind}-{want}.jsonl"
            assert main(["trace", kind, "--duration", "2m", "--config", str(config), "--out", str(out)]) == 0
            assert read_trace(out).models() == [want], kind
    azure = tmp_path / "a.jsonl"
    assert main(["trace", "azure", "--duration", "1h", "--config", str(served), "--out", str(azure)]) == 0
    assert read_trace(tmp_path / "a.jsonl").models() == ["alpha", "beta"]
    assert main(["trace", "poisson", "--model", "x", "--config", str(served), "--out", str(tmp_path / "x.jsonl")]) == 0
    assert read_trace(tmp_path / "x.jsonl").models() == ["x"]
    capsys.readouterr()
    assert main(["trace", "azure", "--models", "3", "--config", str(served), "--out", str(tmp_path / "b.jsonl")]) == 2
    assert "--models 3: the config has 2 (beta, alpha)" in capsys.readouterr().err


def test_a_trace_naming_unserved_models_is_refused_with_the_served_list_and_the_mapping() -> None:
    trace = [rec("model-0")] * 3 + [rec("demo-llama"), rec("demo-llama", adapter="adapter-7")]
    with pytest.raises(TraceMismatch) as info:
        check_served(trace, ["demo-llama", "demo-qwen", "demo-llama-lora-r8"], URL)
    message = str(info.value)
    assert "does not serve: model-0 (3 requests), adapter-7 (1 requests)" in message
    assert "It serves: demo-llama, demo-qwen, demo-llama-lora-r8" in message and URL in message
    assert "--model-map OLD=NEW" in message and "--model-map model-0=demo-llama" in message
    assert "Nothing was sent" in message
    with pytest.raises(TraceMismatch, match="It serves: nothing"):
        check_served(trace, [], URL)


def test_model_map_renames_models_and_adapters_at_load_so_the_trace_fits() -> None:
    mapping = parse_model_map(["model-0=demo-llama", " adapter-7 = demo-llama-lora-r8 "])
    assert mapping == {"model-0": "demo-llama", "adapter-7": "demo-llama-lora-r8"}
    trace = [rec("model-0", prompt=7), rec("model-1"), rec("model-0", adapter="adapter-7")]
    mapped = map_models(trace, mapping)
    assert [(r.model, r.adapter, r.prompt_tokens) for r in mapped] == [
        ("demo-llama", None, 7), ("model-1", None, 10), ("demo-llama", "demo-llama-lora-r8", 10)]
    check_served(map_models([trace[0], trace[2]], mapping), ["demo-llama", "demo-llama-lora-r8"], URL)  # no raise
    for bad in (["model-0"], ["=x"], ["x="], ["a=b", "a=c"]):
        with pytest.raises(ValueError, match="--model-map"):
            parse_model_map(bad)


def test_lengths_over_the_context_are_reported_per_model() -> None:
    trace = [rec("m", 100, 20), rec("m", 2000, 100), rec("m", 10, 3000), rec("n", 5000, 5)]
    notes = length_notes(trace, {"m": 2048, "n": 8192})
    assert notes == ["2 of 3 requests to m need more than its 2048-token context (prompt + output, up to 3010): "
                     "they are shortened to fit and counted as clamped"]
