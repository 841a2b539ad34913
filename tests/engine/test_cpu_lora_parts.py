"""The pure parts of CaraServe's CPU assist: the profiled split, the control records, load pacing."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.cpu_lora_plan import split_rows, updated_throughput
from services.gpu_worker.engine.cpu_lora_wire import HEADER_SIZE, Kind, Record, decode
from services.gpu_worker.engine.lora_loads import AdapterLoads, paced_seconds, pacing_wait
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_runner import ModelRunner
from shared.config_units import Bandwidth


def test_split_follows_measured_throughput_and_covers_every_row():
    plan = split_rows(90, [1.0, 2.0], min_rows=16)
    assert plan == [(0, 0, 30), (1, 30, 60)]
    assert split_rows(20, [5.0, 1.0, 3.0], min_rows=16) == [(0, 0, 12), (2, 12, 8)]  # 2 helpers, the fastest
    assert split_rows(10, [1.0, 9.0], min_rows=16) == [(1, 0, 10)]  # too few rows to split
    assert split_rows(0, [1.0]) == [] and split_rows(5, []) == []
    for total in range(1, 200, 7):
        plan = split_rows(total, [1.0, 3.0, 2.0, 0.5], min_rows=4)
        assert sum(c for _, _, c in plan) == total
        assert all(plan[i][1] + plan[i][2] == plan[i + 1][1] for i in range(len(plan) - 1))
    with pytest.raises(ValueError, match="throughputs must be finite and > 0"):
        split_rows(10, [1.0, 0.0])


def test_throughput_moves_toward_measurements():
    assert updated_throughput(100.0, rows=10, rank=8, seconds=0.1) == pytest.approx(0.7 * 100 + 0.3 * 800)
    assert updated_throughput(100.0, rows=0, rank=8, seconds=0.1) == 100.0


def test_control_records_are_fixed_size_and_checked():
    rec = Record(Kind.COMPUTE, seq=7, adapter=3, layer=1, group=2, row=16, count=16, in_dim=64, out_cols=256)
    data = rec.encode()
    assert len(data) == HEADER_SIZE and decode(data) == rec
    reg = Record(Kind.REGISTER, adapter=4, path="/x/adapter-é")
    assert decode(reg.encode()) == reg
    with pytest.raises(ValueError, match="shorter than its"):
        decode(b"\x04")
    with pytest.raises(ValueError, match="unknown kind 99"):
        decode(bytes([99]) + data[1:])
    with pytest.raises(ValueError, match="only REGISTER has one"):
        decode(data + b"x")


def test_pacing_arithmetic():
    assert paced_seconds(16 << 20, 16e9) == pytest.approx((16 << 20) / 16e9)
    assert paced_seconds(123, None) == 0.0
    assert pacing_wait(started=10.0, now=10.25, nbytes=1_000_000, bandwidth=2e6) == pytest.approx(0.25)
    assert pacing_wait(started=10.0, now=11.0, nbytes=1_000_000, bandwidth=2e6) == 0.0  # the copy took longer
    with pytest.raises(ValueError, match="must be > 0"):
        paced_seconds(1, 0.0)
    assert Bandwidth.parse("16GB/s") == 16e9 and Bandwidth.parse("500MiB/s") == 500 * 2**20
    with pytest.raises(ValueError, match="a bandwidth like"):
        Bandwidth.parse("16GB")


def test_a_paced_load_sleeps_its_bytes_over_the_bandwidth(tmp_path):
    torch.set_num_threads(1)
    base = make_model(tmp_path / "base", layers=1, hidden=64, heads=4, kv_heads=2)
    runner = ModelRunner(base, MemoryPool(32 << 20))
    runner.lora.register("a", make_lora(tmp_path / "a", base, rank=8))
    nbytes = runner.lora.host["a"].nbytes
    slept: list[float] = []
    loads = AdapterLoads(runner.lora, bandwidth=1e6, clock=lambda: 5.0, sleep=slept.append)
    loads.start("a")
    assert "a" not in runner.lora.resident and loads.loading("a")
    assert runner.lora.pool.breakdown()["lora"] == nbytes  # charged from the start of the copy
    while not loads.poll():
        loads.wait(0.1)
    assert slept == [pytest.approx(nbytes / 1e6)]
    assert "a" in runner.lora.resident and not loads.loading("a")
    moved, host = runner.lora.resident["a"][0], runner.lora.host["a"]
    a_dev, a_host = next(iter(moved.weights.values()))[0], next(iter(host.weights.values()))[0]
    assert torch.equal(a_dev, a_host) and a_dev.data_ptr() != a_host.data_ptr()  # a real memory copy
    loads.close()
