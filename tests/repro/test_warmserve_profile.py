"""The fleet cost profile's arithmetic (loadgen/sim/fleet_profile.py) against its sourced numbers."""
from __future__ import annotations

import msgspec
import pytest

from loadgen.sim.fleet_profile import load_fleet_profile

GIB = 2 ** 30


@pytest.fixture(scope="module")
def profile():
    return load_fleet_profile("warmserve-h800-llama2")


def test_the_testbed_and_table_1(profile) -> None:
    assert profile.gpus == 16
    sizes = {m.name: round(m.weights_bytes / GIB, 1) for m in profile.models}
    assert sizes == {"llama2-7b-0": 12.6, "llama2-7b-1": 12.6, "llama2-13b": 24.2, "llama2-70b": 128.5}
    assert all(m.weights_bytes == 2 * m.params for m in profile.models)  # fp16
    assert 6 * profile.model("llama2-7b-0").weights_bytes <= profile.gpu.memory_bytes  # "six whole 7B models"


def test_decode_step_is_the_bandwidth_roofline(profile) -> None:
    m7, m70 = profile.model("llama2-7b-0"), profile.model("llama2-70b")
    bw = 3.35e12 * 0.77
    assert profile.step_cost(m7).overhead_s == pytest.approx(13_476_831_232 / bw)
    assert profile.step_cost(m7).decode_per_ctx_token_s == pytest.approx(524_288 / bw)
    # 70B over 4 GPUs: a quarter of the weights per GPU, plus 2 all-reduces per layer
    assert profile.step_cost(m70).overhead_s == pytest.approx(137_953_306_624 / 4 / bw + 2 * 80 * 1.5e-5)
    assert profile.step_cost(m7).prefill_per_token_s == pytest.approx(2 * 6_738_415_616 / (989e12 * 0.5))


def test_a_compute_share_slows_every_term(profile) -> None:
    m7 = profile.model("llama2-7b-0")
    full, half = profile.step_cost(m7, tp=8), profile.step_cost(m7, tp=8, share=0.5)
    assert half.step_s(10, 5000, 100) == pytest.approx(2 * full.step_s(10, 5000, 100))
    with pytest.raises(ValueError, match="compute share"):
        profile.step_cost(m7, share=0.0)


def test_load_and_start_times_match_figure_8(profile) -> None:
    m70 = profile.model("llama2-70b")
    assert profile.load_s(m70) == pytest.approx(137_953_306_624 / 4 / 8.1e9)
    assert profile.cold_start_s(m70) == pytest.approx(0.595 + profile.load_s(m70))
    prefill = 0.070  # ~1000 prompt tokens on 70B over 4 GPUs
    assert 0.595 + prefill == pytest.approx(0.665, abs=1e-3)  # §7.2: ~665 ms on a prewarm hit
    ratio = (profile.cold_start_s(m70) + prefill) / (profile.hit_start_s() + prefill)
    assert 7.0 <= ratio <= 7.8  # Fig. 8: prewarming weights + communication group, 7.0x-7.8x
    assert profile.hit_start_s(engine_pool=False) == pytest.approx(0.595 + 12.3)


def test_kv_blocks_are_what_the_weights_leave(profile) -> None:
    m7, m70 = profile.model("llama2-7b-0"), profile.model("llama2-70b")
    assert profile.kv_blocks(m7) == (76 * GIB - 13_476_831_232) // (524_288 * 16)
    assert profile.kv_blocks(m70) == (76 * GIB - 137_953_306_624 // 4) * 4 // (327_680 * 16)


def test_bad_profiles_are_refused(profile, tmp_path) -> None:
    with pytest.raises(ValueError, match="built-ins: warmserve-h800-llama2"):
        load_fleet_profile("no-such-profile")
    with pytest.raises(KeyError, match="no model 'gpt'"):
        profile.model("gpt")
    huge = msgspec.structs.replace(profile.model("llama2-70b"), parallel=1)
    with pytest.raises(ValueError, match="do not fit"):
        profile.kv_blocks(huge)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    with pytest.raises(ValueError, match="fleet profile"):
        load_fleet_profile(bad)


def test_loads_go_through_the_one_movement_cost_model(profile) -> None:
    m7, m70 = profile.model("llama2-7b-0"), profile.model("llama2-70b")
    costs = profile.movement_costs()
    assert profile.load_s(m70) == pytest.approx(costs.load_s(137_953_306_624 // 4, in_host_memory=True))
    assert profile.load_s(m7, 1 << 30) == pytest.approx(costs.host.transfer_s(1 << 30))  # prewarmed bytes so far
    from_disk = profile.load_s(m7, in_host_memory=False)
    assert from_disk > profile.load_s(m7)  # storage first, then the host link
    assert from_disk == pytest.approx(costs.host.transfer_s(13_476_831_232) + costs.disk.transfer_s(13_476_831_232))
    on_disk = msgspec.structs.replace(profile, startup=msgspec.structs.replace(profile.startup,
                                                                              checkpoints_in_host_memory=False))
    assert on_disk.cold_start_s(m7) == pytest.approx(profile.hit_start_s() + from_disk)


def test_a_profile_without_a_disk_link_cannot_keep_checkpoints_on_disk(tmp_path) -> None:
    from loadgen.sim.fleet_profile import FLEET_DIR

    text = (FLEET_DIR / "warmserve-h800-llama2.toml").read_text()
    bad = tmp_path / "nodisk.toml"
    bad.write_text(text.replace('disk_link = "disk"', 'disk_link = ""').replace(
        "checkpoints_in_host_memory = true", "checkpoints_in_host_memory = false"))
    with pytest.raises(ValueError, match="disk_link is empty"):
        load_fleet_profile(bad)
    bad.write_text(text.replace('host_link = "host"', 'host_link = "pcie9"'))
    with pytest.raises(ValueError, match="link\\(s\\) pcie9 not in"):
        load_fleet_profile(bad)
