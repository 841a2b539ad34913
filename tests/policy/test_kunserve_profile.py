"""KunServe's pipeline cost model: the default profile's published numbers, and bad profiles named."""
from __future__ import annotations

from pathlib import Path

import pytest

from shared.policy.kunserve_profile import PipelineProfile, StageOverhead, decode_pipeline_profile
from shared.profiles import DEFAULT_PIPELINE_PROFILE, PROFILES_DIR, builtin_pipeline_profiles, load_pipeline_profile

GOOD = """
name = "two"
[[stages]]
stages = 1
throughput_efficiency = 1.0
source = "definition"
[[stages]]
stages = 2
throughput_efficiency = 0.9
tbt_factor = 1.2
source = "measured"
"""


def test_default_profile_carries_kunserves_published_numbers() -> None:
    p = load_pipeline_profile()
    assert p.name == DEFAULT_PIPELINE_PROFILE and DEFAULT_PIPELINE_PROFILE in builtin_pipeline_profiles()
    assert p.max_stages == 8
    two, eight = p.overhead(2), p.overhead(8)
    # §5.2: 12.6-21.8% lower throughput, 1.6-2.0x TBT, 1.7-1.8x TTFT (midpoints)
    assert two.throughput_efficiency == pytest.approx(1 - (0.126 + 0.218) / 2)
    assert (two.tbt_factor, two.ttft_factor) == (1.8, 1.75) and "§5.2" in two.source
    # §3 / Fig. 5: an 8-stage pipeline, 5.1x P99 TBT and 5.4x P99 TTFT
    assert (eight.tbt_factor, eight.ttft_factor) == (5.1, 5.4) and "Fig. 5" in eight.source
    # the unpublished depths say so
    assert all("extrapolated" in p.overhead(k).source for k in range(3, 9))
    effs = [p.efficiency(k) for k in range(1, 9)]
    assert effs == sorted(effs, reverse=True)
    text = (PROFILES_DIR / f"{DEFAULT_PIPELINE_PROFILE}.toml").read_text()
    assert "KunServe" in text and "12.6-21.8%" in text and "5.4x" in text  # the file cites its sources


def test_costs_follow_section_4_1() -> None:
    p = load_pipeline_profile()
    assert p.throughput([1] * 8) == 8 and p.cost([1] * 8) == 1.0
    assert p.cost([2, 2, 2, 2]) == pytest.approx(1 / 0.828)
    assert p.cost([8]) > p.cost([4, 4]) > p.cost([2, 2, 2, 2])
    with pytest.raises(ValueError, match="covers 1..8 stages, not 9"):
        p.overhead(9)


def test_profiles_load_from_files(tmp_path: Path) -> None:
    toml = tmp_path / "p.toml"
    toml.write_text(GOOD)
    assert load_pipeline_profile(toml).efficiency(2) == 0.9
    js = tmp_path / "p.json"
    js.write_text('{"name": "j", "stages": [{"stages": 1, "throughput_efficiency": 1.0, "source": "d"}]}')
    assert load_pipeline_profile(js).max_stages == 1
    with pytest.raises(ValueError, match="cannot read"):
        load_pipeline_profile(tmp_path / "missing.toml")


@pytest.mark.parametrize("text, message", [
    (GOOD.replace("stages = 2", "stages = 3"), "must cover 1, 2"),
    (GOOD.replace("0.9", "1.1"), "throughput_efficiency"),
    (GOOD.replace("1.0\nsource", "0.9\nsource").replace("0.9\ntbt", "0.5\ntbt"), "1 stage is an unsplit"),
    (GOOD.replace('source = "measured"', 'source = "measured"\nbogus = 1'), "bogus"),
    (GOOD.replace('source = "measured"\n', ""), "source"),
    (GOOD + '[[stages]]\nstages = 3\nthroughput_efficiency = 0.95\nsource = "x"\n', "rises from 2 to 3"),
])
def test_bad_profiles_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        decode_pipeline_profile(text, origin="bad.toml")
    assert "bad.toml" in str(info.value)


def test_profiles_built_in_code_are_validated_too() -> None:
    with pytest.raises(ValueError, match="rises"):
        PipelineProfile(name="x", stages=[StageOverhead(stages=1, throughput_efficiency=1.0, source="d"),
                                          StageOverhead(stages=2, throughput_efficiency=0.5, source="d"),
                                          StageOverhead(stages=3, throughput_efficiency=0.6, source="d")])
