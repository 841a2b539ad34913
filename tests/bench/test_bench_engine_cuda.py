"""The CUDA engine bench's parts on CPU (a dry run of `tidal bench engine --device cuda:N`): the
roofline arithmetic on the real 8B shape, and a tiny generated shape driven through the bench's
rows on the engine's CPU runner (weights made in memory, KV blocks filled, decode and prefill
timed, a row that does not fit skipped with its reason), the table and the summary line."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import write_config
from services.gpu_worker.engine.model_config import load_model_config
from tidal.bench import engine_cuda
from tidal.bench.engine_roofline import decode_cost, device_peaks, prefill_cost


def test_peaks_are_read_off_the_device_name():
    assert device_peaks("NVIDIA H200").hbm_bytes_per_s == 4.8e12
    assert device_peaks("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert device_peaks("NVIDIA H100 PCIe").bf16_flops == 756e12
    assert device_peaks("NVIDIA GeForce RTX 4090") is None


def test_roofline_costs_of_the_8b_shape(tmp_path):
    cfg = load_model_config(write_config(tmp_path, **engine_cuda.SHAPES["llama-8b"]))
    nbytes, flops = decode_cost(cfg, 64, 4096)
    weights = 8.03e9 * 2  # Llama 3.1 8B: 8.03 B parameters in bf16 (the embedding's rows aside)
    kv = 64 * 4096 * 32 * 2 * 8 * 128 * 2  # 34.4 GB: K and V of 32 layers, 8 kv heads x 128
    assert nbytes == pytest.approx(weights - 128256 * 4096 * 2 + kv, rel=0.01)
    assert flops == pytest.approx(2 * 64 * (8.03e9 - 128256 * 4096) + 4 * 64 * 4096 * 32 * 128 * 32, rel=0.01)
    _, prefill = prefill_cost(cfg, 2048)
    assert prefill == pytest.approx(2 * 2048 * 6.98e9 + 2 * 2048**2 * 4096 * 32, rel=0.01)


def test_rows_of_a_tiny_shape_on_the_cpu_runner(tmp_path, monkeypatch):
    monkeypatch.setitem(engine_cuda.SHAPES, "tiny", dict(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2,
                                                         intermediate=128, vocab=512))
    monkeypatch.setattr(engine_cuda, "MAX_POSITION", 256)
    torch.manual_seed(0)
    bench = engine_cuda.ShapeBench("tiny", "cpu", tmp_path, device_peaks("NVIDIA H200"), (4e12, 8e14), steps=2)
    try:
        assert bench.cfg.qkv_bias and bench.runner.model.layers[0].bqkv is not None
        decode = bench.decode(4, 40, eager=True)
        prefill = bench.prefill(64)
        monkeypatch.setattr(engine_cuda, "HEADROOM", 1 << 60)  # nothing fits any more
        skipped = bench.decode(4, 200, eager=False)
    finally:
        bench.close()
    assert decode.skipped is None and decode.step_ms > 0 and decode.tokens_per_s == pytest.approx(4e3 / decode.step_ms)
    assert 0 < decode.fraction < 1 and decode.roofline_ms > 0
    assert decode.gpu_ms is None and decode.eager_ms is None  # no graphs on CPU
    assert prefill.mfu is not None and 0 < prefill.mfu < 1
    assert skipped.skipped is not None and "GiB of KV" in skipped.skipped
    rows = [decode, prefill, skipped]
    table = engine_cuda.markdown(rows, "Device: test")
    assert table.count("\n| tiny |") == 3 and "skipped: needs" in table
    assert engine_cuda.summary(rows) == ("bench engine (cuda): decode_roofline_b64=- decode_roofline_b8=- "
                                         "prefill_mfu_2k=- step_overhead=-")


def test_summary_reports_batch_8_beside_batch_64() -> None:
    from tidal.bench.engine_cuda import Row, summary

    ctx = engine_cuda.SUMMARY_CONTEXT
    rows = [Row("llama-8b", "decode", 64, ctx, fraction=0.77, overhead=0.04),
            Row("llama-8b", "decode", 8, ctx, fraction=0.65),
            Row("llama-8b", "decode", 8, 512, fraction=0.10),  # another context: not the b8 figure
            Row("llama-8b", "prefill", 1, engine_cuda.SUMMARY_PREFILL, mfu=0.68)]
    assert summary(rows) == ("bench engine (cuda): decode_roofline_b64=77% decode_roofline_b8=65% "
                             "prefill_mfu_2k=68% step_overhead=4%")
