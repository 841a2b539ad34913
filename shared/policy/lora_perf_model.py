"""CaraServe §5 performance models: step latency of a batch of heterogeneous LoRA ranks.

Pure: no I/O, no clock. The two batched LoRA kernels cost differently (Fig. 4, Fig. 9):

- padded (Punica's BGMV; `[policies] lora_kernel = "padded"`): every adapter is padded to
  the batch's highest rank, so a decode step grows with |S| x max rank;
- segmented (S-LoRA's MBGMV; "segmented"): no padding, so it grows with the sum of ranks.

The paper's models are `alpha * feature + beta`. On a CPU engine the base model's own
cost also grows with the batch (it is not memory-bound on one matrix), so each fit here has
a second term, `gamma` per request (decode) or per token (prefill); `gamma = 0` is the
paper's form exactly (`fit_linear(..., with_gamma=False)`). A request without an adapter
has rank 0. Prefill features: padded, tokens x max rank; segmented, the sum over requests
of tokens x own rank.

`tidal profile lora` measures the engine and fits these (loadgen/profiler/lora.py); the
rank-aware router (shared/policy/lora_routing.py) and the simulator load the result.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

Kernel = Literal["padded", "segmented"]
KERNELS: tuple[Kernel, ...] = ("padded", "segmented")


def decode_feature(kernel: Kernel, ranks: Sequence[int]) -> float:
    """The rank term of a decode step over `ranks` (one per sequence, 0 = no adapter)."""
    if not ranks:
        return 0.0
    return float(len(ranks) * max(ranks)) if kernel == "padded" else float(sum(ranks))


def prefill_feature(kernel: Kernel, prompts: Sequence[tuple[int, int]]) -> float:
    """The rank term of a prefill step over `prompts`: (tokens, rank) per request."""
    if not prompts:
        return 0.0
    if kernel == "padded":
        return float(sum(t for t, _ in prompts) * max(r for _, r in prompts))
    return float(sum(t * r for t, r in prompts))


class LinearFit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """seconds = alpha_s * rank_feature + gamma_s * size + beta_s (size: requests or tokens)."""

    alpha_s: float
    gamma_s: float = 0.0
    beta_s: float = 0.0
    r2: float | None = None  # of the fit over its points (None: set by hand)
    points: int = 0

    def seconds(self, feature: float, size: float) -> float:
        return self.alpha_s * feature + self.gamma_s * size + self.beta_s


class LoraPerfModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One kernel's prefill and decode models (PrePerf, DecPerf of Alg. 1)."""

    kernel: Kernel
    decode: LinearFit
    prefill: LinearFit

    def decode_s(self, ranks: Sequence[int]) -> float:
        """One decode step of a batch with these ranks; 0 for an empty batch (no step)."""
        return self.decode.seconds(decode_feature(self.kernel, ranks), len(ranks)) if ranks else 0.0

    def prefill_s(self, prompts: Sequence[tuple[int, int]]) -> float:
        """Prefilling these (tokens, rank) prompts; 0 when there are none."""
        if not prompts:
            return 0.0
        return self.prefill.seconds(prefill_feature(self.kernel, prompts), sum(t for t, _ in prompts))


class LoraPerfProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What `tidal profile lora` writes: a model per kernel, and where they were measured."""

    name: str = "caraserve-fig5"
    description: str = ("Llama2-7B on an A10 (CaraServe §2.3 Fig. 5's worked example: 24 x rank 32 -> 34.8 ms / "
                        "35.3 ms, 16 x rank 64 -> 35.8 ms / 35.9 ms for BGMV / MBGMV); prefill not published, "
                        "a placeholder of 0.1 ms per token")
    padded: LoraPerfModel | None = None
    segmented: LoraPerfModel | None = None
    # bytes/s an adapter loads at (host to device), pricing a cold load in rank-aware routing where
    # the worker's own `lora_load_bandwidth` is not configured; None: unknown (not priced)
    adapter_load_bytes_per_s: float | None = None

    def model(self, kernel: Kernel) -> LoraPerfModel:
        found = self.padded if kernel == "padded" else self.segmented
        if found is None:
            raise ValueError(f"LoRA profile {self.name!r} has no model for the {kernel!r} kernel")
        return found


def _paper_default() -> LoraPerfProfile:
    # Two points per kernel from Fig. 5 give alpha and beta exactly (decode, gamma = 0).
    prefill = LinearFit(alpha_s=0.0, gamma_s=1e-4, beta_s=0.0)
    bgmv = LinearFit(alpha_s=1e-3 / 256, beta_s=31.8e-3)  # (35.8 - 34.8) ms / (16*64 - 24*32)
    mbgmv = LinearFit(alpha_s=0.6e-3 / 256, beta_s=33.5e-3)  # (35.9 - 35.3) ms / (1024 - 768)
    return LoraPerfProfile(padded=LoraPerfModel(kernel="padded", decode=bgmv, prefill=prefill),
                           segmented=LoraPerfModel(kernel="segmented", decode=mbgmv, prefill=prefill))


PAPER_PROFILE = _paper_default()


def fit_linear(features: Sequence[float], sizes: Sequence[float], seconds: Sequence[float], *,
               with_gamma: bool = True) -> LinearFit:
    """Least squares of seconds on (feature, size, 1); R^2 over the same points."""
    n = len(seconds)
    if n != len(features) or n != len(sizes):
        raise ValueError(f"features ({len(features)}), sizes ({len(sizes)}) and seconds ({n}) differ in length")
    columns = 3 if with_gamma else 2
    if n < columns:
        raise ValueError(f"need at least {columns} measured points to fit, got {n}")
    y = np.asarray(seconds, dtype=float)
    cols = [np.asarray(features, dtype=float)] + ([np.asarray(sizes, dtype=float)] if with_gamma else [])
    x = np.column_stack([*cols, np.ones(n)])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    predicted = x @ coef
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0
    alpha, gamma, beta = (coef[0], coef[1], coef[2]) if with_gamma else (coef[0], 0.0, coef[1])
    return LinearFit(alpha_s=float(alpha), gamma_s=float(gamma), beta_s=float(beta), r2=r2, points=n)


class DecodeSample(msgspec.Struct, frozen=True, kw_only=True):
    ranks: tuple[int, ...]  # one per sequence in the batch
    seconds: float


class PrefillSample(msgspec.Struct, frozen=True, kw_only=True):
    prompts: tuple[tuple[int, int], ...]  # (tokens, rank) per request prefilled in the step
    seconds: float


def fit_model(kernel: Kernel, decode: Sequence[DecodeSample], prefill: Sequence[PrefillSample]) -> LoraPerfModel:
    """Fit both models of one kernel from measured steps."""
    dec = fit_linear([decode_feature(kernel, s.ranks) for s in decode], [len(s.ranks) for s in decode],
                     [s.seconds for s in decode])
    pre = fit_linear([prefill_feature(kernel, s.prompts) for s in prefill],
                     [sum(t for t, _ in s.prompts) for s in prefill], [s.seconds for s in prefill])
    return LoraPerfModel(kernel=kernel, decode=dec, prefill=pre)


def encode_profile(profile: LoraPerfProfile) -> bytes:
    return msgspec.json.format(msgspec.json.encode(profile)) + b"\n"


def decode_profile(data: bytes, *, source: str = "LoRA profile", toml: bool = False) -> LoraPerfProfile:
    """Parse a profile (JSON, or TOML); a bad one raises ValueError naming `source` and the field."""
    try:
        if toml:
            return msgspec.toml.decode(data, type=LoraPerfProfile)
        return msgspec.json.decode(data, type=LoraPerfProfile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{source}: {exc}") from None


__all__ = [
    "KERNELS", "PAPER_PROFILE", "DecodeSample", "Kernel", "LinearFit", "LoraPerfModel", "LoraPerfProfile",
    "PrefillSample", "decode_feature", "decode_profile", "encode_profile", "fit_linear", "fit_model",
    "prefill_feature",
]
