"""The one movement cost model: Llumnix's multi-stage pre-copy, restores and loads."""
from __future__ import annotations

import pytest

from loadgen.sim.profile import LinkSpec, load_profile
from shared.policy.movement import MovementSpec, movement_costs

BLOCK = 16 * 196_608  # a Qwen-2.5-14B block of 16 tokens
LINKS = {"rdma": LinkSpec(name="rdma", latency_s=1e-5, bandwidth_bytes_per_s=2.5e10),
         "pcie": LinkSpec(name="pcie", latency_s=1e-5, bandwidth_bytes_per_s=3.2e10),
         "slow": LinkSpec(name="slow", latency_s=1e-4, bandwidth_bytes_per_s=1.25e8)}


def costs(kv: str = "rdma", **spec):
    return movement_costs(MovementSpec(kv_link=kv, host_link="pcie", disk_link="", **spec), LINKS)


def test_precopy_on_a_fast_link_converges_with_a_small_last_stage() -> None:
    # 1000 tokens = 63 blocks (198 MB) in 7.9 ms over RDMA; a 30 ms decode step writes no new block
    m = costs().kv_precopy(1000, 16, BLOCK, decode_step_s=0.03)
    assert m.ok and m.stages == 2
    assert m.precopy_s == pytest.approx(LINKS["rdma"].transfer_s(63 * BLOCK))
    assert m.stall_s == pytest.approx(LINKS["rdma"].transfer_s(1 * BLOCK))  # the partly written block again
    assert m.blocks == 64


def test_a_short_request_moves_in_one_stopped_stage() -> None:
    m = costs().kv_precopy(100, 16, BLOCK, decode_step_s=0.03)
    assert m.ok and m.stages == 1 and m.precopy_s == 0.0
    assert m.stall_s == pytest.approx(LINKS["rdma"].transfer_s(7 * BLOCK))


def test_precopy_that_cannot_converge_fails_after_the_stage_limit() -> None:
    # at 125 MB/s a 4000-token request takes 6.3 s per stage while it writes 12 tokens/s... still
    # converges; at 2 ms a token it writes ~3150 tokens (197 blocks) per stage: never under 16
    m = costs("slow").kv_precopy(4000, 16, BLOCK, decode_step_s=0.002)
    assert not m.ok and m.stages == 3 and "3 stages" in m.reason
    assert m.precopy_s > 3 * LINKS["slow"].transfer_s(100 * BLOCK)
    with pytest.raises(ValueError, match="ctx_tokens"):
        costs().kv_precopy(0, 16, BLOCK, 0.03)


def test_restores_and_loads_use_their_links() -> None:
    c = costs()
    assert c.layer_restore_s(10**9) == pytest.approx(LINKS["pcie"].transfer_s(10**9))
    assert c.layer_restore_s(10**9, source="peer") == pytest.approx(LINKS["rdma"].transfer_s(10**9))
    assert c.load_s(10**8, in_host_memory=True) == pytest.approx(LINKS["pcie"].transfer_s(10**8))
    with pytest.raises(ValueError, match="no disk link"):
        c.load_s(10**8, in_host_memory=False)


def test_a_missing_link_is_named() -> None:
    with pytest.raises(ValueError, match="link\\(s\\) nvme not in"):
        movement_costs(MovementSpec(kv_link="rdma", host_link="pcie", disk_link="nvme"), LINKS)


@pytest.mark.parametrize("name", ["cpu", "a800-qwen2.5-14b", "a100-7b", "rtx4090-llama2-7b", "a100-40g-llama2-13b"])
def test_every_shipped_profile_resolves_its_movement_links(name: str) -> None:
    p = load_profile(name)
    m = p.movement_costs()
    assert m.kv.bandwidth_bytes_per_s > 0 and m.host.bandwidth_bytes_per_s > 0
