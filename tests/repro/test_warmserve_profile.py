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


def test_step_times_are_the_public_codes_measurements(profile) -> None:
    m7, m13, m70 = profile.model("llama2-7b-0"), profile.model("llama2-13b"), profile.model("llama2-70b")
    # trace-generator/common.py time_dict: (prefill, decode) ms = (35, 15), (70, 20), (100, 30)
    for m, decode, prefill in ((m7, 0.015, 0.035), (m13, 0.020, 0.070), (m70, 0.030, 0.100)):
        cost = profile.step_cost(m)
        assert cost.overhead_s == pytest.approx(decode)
        assert cost.step_s(0, 0, 1024) == pytest.approx(prefill)  # a 1,024-token prompt takes the measured prefill
        assert cost.step_s(1, 500) == pytest.approx(decode, rel=0.02)  # one request decoding: the measured step
    bw = 3.35e12 * 0.77  # a batch adds its KV reads and per-token compute (roofline)
    assert profile.step_cost(m7).decode_per_ctx_token_s == pytest.approx(524_288 / bw)
    assert profile.step_cost(m7).decode_per_seq_s == pytest.approx(2 * 6_738_415_616 / (989e12 * 0.5))
    assert profile.step_cost(m7).step_s(32, 32 * 1000) < 0.025  # a full batch: ~22 ms
    # another TP degree (MuxServe's enlarged parallelism) scales the measured step by the roofline's ratio
    wide = profile.step_cost(m7, tp=8)
    roof1 = 13_476_831_232 / bw
    roof8 = 13_476_831_232 / 8 / bw + 2 * 32 * 1.5e-5
    assert wide.overhead_s == pytest.approx(0.015 * roof8 / roof1)
    # the public code's characterisation of a request: prefill_time + output x decode_time
    assert profile.request_s(m70, 700, 200) == pytest.approx(0.100 + 200 * 0.030)


def test_the_engine_is_vllm_0_6_as_the_public_code_starts_it(profile) -> None:
    spec = profile.worker_spec(profile.model("llama2-7b-0"))
    assert (spec.engine_mode, spec.max_batched_tokens, spec.watermark, spec.max_batch) == ("vllm-0.6", 100_000, 0.01, 32)
    assert spec.max_model_len == 2048


def test_a_compute_share_slows_every_term(profile) -> None:
    m7 = profile.model("llama2-7b-0")
    full, half = profile.step_cost(m7, tp=8), profile.step_cost(m7, tp=8, share=0.5)
    assert half.step_s(10, 5000, 100) == pytest.approx(2 * full.step_s(10, 5000, 100))
    with pytest.raises(ValueError, match="compute share"):
        profile.step_cost(m7, share=0.0)


def test_load_and_start_times_match_figure_8(profile) -> None:
    m70 = profile.model("llama2-70b")
    assert profile.load_s(m70) == pytest.approx(137_953_306_624 / 4 / 8.1e9)
    assert profile.cold_start_s(m70) == pytest.approx(0.634 + profile.load_s(m70))
    first = profile.step_cost(m70).step_s(0, 0, 16)  # Fig. 8's short prompt: one 70B step
    assert first == pytest.approx(0.0305, abs=1e-3)
    assert 0.634 + first == pytest.approx(0.665, abs=1e-3)  # §7.2: ~665 ms on a prewarm hit
    ratio = (profile.cold_start_s(m70) + first) / (profile.hit_start_s() + first)
    assert 7.0 <= ratio <= 7.8  # Fig. 8: prewarming weights + communication group, 7.0x-7.8x
    assert profile.hit_start_s(engine_pool=False) == pytest.approx(0.634 + 12.3)


def test_every_models_cold_start_is_figure_8s_multiple_of_its_hit(profile) -> None:
    """Issue 30: one 0.634 s hit for every model made a cold 7B start 3.6x its hit; Fig. 8 gives 7.0x-7.8x."""
    for m in profile.models:
        first = profile.step_cost(m).step_s(0, 0, 16)
        ratio = (profile.cold_start_s(m) + first) / (profile.hit_start_s(True, m) + first)
        assert 7.0 <= ratio <= 7.8, (m.name, ratio)
    m7 = profile.model("llama2-7b-0")
    assert profile.hit_start_s(True, m7) == pytest.approx(0.245)
    assert profile.hit_start_s(False, m7) == pytest.approx(0.245 + 12.3)  # no pool: the engine on every start
    assert profile.hit_start_s() == pytest.approx(0.634)  # no model: the profile's figure (the 70B's)
    assert profile.hit_start_s(True, m7) < profile.hit_start_s(True, profile.model("llama2-70b"))


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
    assert on_disk.cold_start_s(m7) == pytest.approx(profile.hit_start_s(True, m7) + from_disk)


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
