"""`tidal bench prefix`'s pure parts: the arms' configs (the default config with each arm's switches, parsed
by the real schema), the figures and the summary line (tokens_equal says no when an output differs)."""
from __future__ import annotations

import re
from pathlib import Path

from shared.config import parse_config
from tidal.bench.prefix_drive import DEFAULT_CONFIG, arm_config, set_key
from tidal.bench.prefix_stats import ArmResult, Outcome, hit_rate, percentile, summary_line, tokens_equal

LINE = re.compile(r"^bench prefix: ttft_p50_cut=\d+\.\dx ttft_p99_cut=\d+\.\dx hit_rate=\d+% "
                  r"routed_hit_rate=\d+% tokens_equal=(yes|no)$")


def test_each_arm_is_the_default_config_with_its_switches(tmp_path: Path) -> None:
    base = DEFAULT_CONFIG.read_text()
    for arm, caching, routing in (("off", False, False), ("on", True, False), ("routed", True, True)):
        cfg = parse_config(arm_config(arm, data_dir=tmp_path, port=18123, base=base))
        assert (cfg.policies.prefix_caching, cfg.dispatcher.prefix_routing) == (caching, routing)
        assert cfg.gateway.port == 18123 and Path(cfg.cluster.data_dir) == tmp_path
        assert [w.id for w in cfg.workers] == ["cpu-0", "cpu-1"]  # the default cluster otherwise
        assert cfg.policies.migration == "off" and cfg.planner.enabled
    kept = parse_config(arm_config("on", data_dir=tmp_path, port=18123, base=base, migration=True))
    assert kept.policies.migration == parse_config(base).policies.migration


def test_set_key_replaces_within_its_section_or_adds() -> None:
    text = "[a]\nx = 1\n\n[b]\nx = 2\n"
    assert set_key(text, "b", "x", "3") == "[a]\nx = 1\n\n[b]\nx = 3\n"
    assert set_key(text, "a", "y", "4").startswith("[a]\ny = 4\nx = 1\n")
    assert set_key(text, "c", "z", "5").endswith("[c]\nz = 5\n")


def _arm(arm: str, ttfts: list[float], texts: list[str], hits: dict[str, tuple[int, int]]) -> ArmResult:
    outcomes = [Outcome(i, "system", float(i), t, t + 1.0, 16, x) for i, (t, x) in enumerate(zip(ttfts, texts))]
    return ArmResult(arm, outcomes, hits)


def test_the_summary_line_cuts_off_against_routed() -> None:
    texts = ["a", "b", "c", "d"]
    off = _arm("off", [0.8, 0.8, 0.8, 1.6], texts, {})
    on = _arm("on", [0.4, 0.4, 0.4, 0.8], texts, {"cpu-0": (100, 50), "cpu-1": (100, 30)})
    routed = _arm("routed", [0.2, 0.2, 0.2, 0.4], texts, {"cpu-0": (100, 90), "cpu-1": (100, 80)})
    line = summary_line({"off": off, "on": on, "routed": routed})
    assert LINE.match(line), line
    assert "ttft_p50_cut=4.0x" in line and "hit_rate=40%" in line and "routed_hit_rate=85%" in line
    assert line.endswith("tokens_equal=yes")
    routed.outcomes[2] = Outcome(2, "system", 2.0, 0.2, 1.2, 16, "different")
    assert tokens_equal([off, on, routed]) is False
    assert summary_line({"off": off, "on": on, "routed": routed}).endswith("tokens_equal=no")


def test_a_failed_request_makes_outputs_unequal_and_off_has_no_hit_rate() -> None:
    ok = _arm("on", [0.1, 0.2], ["a", "b"], {})
    failed = ArmResult("off", [Outcome(0, "chat", 0.0, 0.1, 1.0, 16, "a"),
                               Outcome(1, "chat", 1.0, None, None, 0, "", error="boom")])
    assert not tokens_equal([ok, failed])
    assert hit_rate({}) is None and hit_rate({"w": (0, 0)}) is None
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([1.0, 3.0], 99) == 2.98
