"""The physical limits an engine step is measured against: the device's peaks and what a
step must move and compute.

Decode is bound by memory: a step reads every weight once (the embedding only for its
rows) and each sequence's K and V once, so its floor is those bytes over the HBM bandwidth.
Prefill is bound by the matrix units: its floor is its FLOPs over the dense bf16 peak (MFU
is that floor over the measured time). A row's roofline time is the larger of the two.

Peaks come from the vendor's datasheets (PEAKS, matched on the name CUDA reports); the
bench also measures a device-to-device copy and a large bf16 matmul on the card in hand
and reports fractions of both.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense (no sparsity)
    source: str


# NVIDIA datasheets: H100 Tensor Core GPU (SXM5 / PCIe / NVL) and H200 Tensor Core GPU (SXM / NVL);
# A100 80GB datasheet. Order matters: the first whose keys all appear in the device name wins.
PEAKS: list[tuple[tuple[str, ...], DevicePeaks]] = [
    (("H200", "NVL"), DevicePeaks("H200 NVL", 4.8e12, 835e12, "NVIDIA H200 datasheet")),
    (("H200",), DevicePeaks("H200 SXM", 4.8e12, 989e12, "NVIDIA H200 datasheet")),
    (("H100", "NVL"), DevicePeaks("H100 NVL", 3.9e12, 835e12, "NVIDIA H100 datasheet")),
    (("H100", "PCIe"), DevicePeaks("H100 PCIe", 2.0e12, 756e12, "NVIDIA H100 datasheet")),
    (("H100",), DevicePeaks("H100 SXM", 3.35e12, 989e12, "NVIDIA H100 datasheet")),
    (("A100",), DevicePeaks("A100 SXM 80GB", 2.039e12, 312e12, "NVIDIA A100 datasheet")),
]


def device_peaks(device_name: str) -> DevicePeaks | None:
    for keys, peaks in PEAKS:
        if all(k.lower() in device_name.lower() for k in keys):
            return peaks
    return None


def _matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies in the decoder layers (no embedding, no head)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return cfg.num_layers * ((q + 2 * kv) * h + q * h + 3 * inter * h)


def weight_bytes_read(cfg: ModelConfig, rows: int) -> int:
    """Weight bytes a step over `rows` tokens reads: every layer, the head, norms, the
    embedding's rows only."""
    item = cfg.dtype.itemsize
    h = cfg.hidden_size
    layers = _matmul_params(cfg) + cfg.num_layers * 2 * h + (cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size)
                                                             if cfg.qkv_bias else 0)
    head = cfg.vocab_size * h + h
    return (layers + head + rows * h) * item


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize


def decode_cost(cfg: ModelConfig, batch: int, context: int) -> tuple[int, float]:
    """(bytes, FLOPs) of one decode step: `batch` sequences with `context` keys each."""
    nbytes = weight_bytes_read(cfg, batch) + batch * context * kv_bytes_per_token(cfg)
    attn = 4 * batch * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    flops = 2 * batch * (_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size) + attn
    return nbytes, float(flops)


def prefill_cost(cfg: ModelConfig, tokens: int) -> tuple[int, float]:
    """(bytes, FLOPs) of one prompt of `tokens` in one chunk (causal attention: half the
    square; logits for the last token only)."""
    nbytes = weight_bytes_read(cfg, tokens) + tokens * kv_bytes_per_token(cfg)
    attn = 2 * tokens * tokens * cfg.num_heads * cfg.head_dim * cfg.num_layers
    flops = 2 * tokens * _matmul_params(cfg) + 2 * cfg.vocab_size * cfg.hidden_size + attn
    return nbytes, float(flops)


def roofline_s(nbytes: int, flops: float, bandwidth: float, peak_flops: float) -> float:
    return max(nbytes / bandwidth, flops / peak_flops)


def measure_ceilings(device: str) -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s) measured on the device."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def timed(fn, reps: int) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    copy_s = timed(lambda: dst.copy_(src), 20)
    mm_s = timed(lambda: a @ b, 10)
    del src, dst, a, b
    return 2 * (1 << 30) / copy_s, 2 * 8192**3 / mm_s
