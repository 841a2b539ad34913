"""CaraServe §5 performance models: features, least-squares fit, R², the profile file (pure)."""
from __future__ import annotations

import numpy as np
import pytest

from shared.policy.lora_perf_model import (
    PAPER_PROFILE, DecodeSample, LinearFit, LoraPerfModel, LoraPerfProfile, PrefillSample, decode_feature,
    decode_profile, encode_profile, fit_linear, fit_model, prefill_feature,
)


def test_features_follow_each_kernel() -> None:
    # padded pads to the max rank: |S| x max; segmented sums the ranks
    assert decode_feature("padded", [8, 64, 0]) == 3 * 64
    assert decode_feature("segmented", [8, 64, 0]) == 72
    assert decode_feature("padded", []) == 0
    assert prefill_feature("padded", [(10, 8), (30, 16)]) == 40 * 16
    assert prefill_feature("segmented", [(10, 8), (30, 16)]) == 10 * 8 + 30 * 16


def test_paper_profile_reproduces_fig5_latencies() -> None:
    # Fig. 5: instance 1 runs 24 x rank 32, instance 2 runs 16 x rank 64
    bgmv, mbgmv = PAPER_PROFILE.model("padded"), PAPER_PROFILE.model("segmented")
    assert bgmv.decode_s([32] * 24) == pytest.approx(34.8e-3)
    assert bgmv.decode_s([64] * 16) == pytest.approx(35.8e-3)
    assert mbgmv.decode_s([32] * 24) == pytest.approx(35.3e-3)
    assert mbgmv.decode_s([64] * 16) == pytest.approx(35.9e-3)
    # a new rank-64 request: BGMV on instance 1 pads 25 requests to 64 and breaks 36 ms
    assert bgmv.decode_s([32] * 24 + [64]) > 36e-3 + 2e-3
    assert mbgmv.decode_s([32] * 24 + [64]) < 36e-3 < mbgmv.decode_s([64] * 17)


def test_fit_recovers_coefficients_and_r2() -> None:
    rng = np.random.default_rng(0)
    feats = rng.uniform(0, 2000, 40)
    sizes = rng.integers(1, 32, 40).astype(float)
    exact = 2e-6 * feats + 3e-4 * sizes + 5e-3
    fit = fit_linear(feats, sizes, exact)
    assert (fit.alpha_s, fit.gamma_s, fit.beta_s) == pytest.approx((2e-6, 3e-4, 5e-3), rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.points == 40
    noisy = exact + rng.normal(0, 2e-4, 40)
    assert 0.9 < fit_linear(feats, sizes, noisy).r2 < 1.0
    paper_form = fit_linear([768, 1024], [24, 16], [34.8e-3, 35.8e-3], with_gamma=False)
    assert paper_form.gamma_s == 0 and paper_form.alpha_s == pytest.approx(1e-3 / 256)


def test_fit_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 3 measured points"):
        fit_linear([1, 2], [1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        fit_linear([1, 2, 3], [1, 1], [0.1, 0.2, 0.3])


def test_fit_model_per_kernel_tells_max_from_sum() -> None:
    # data made by a padded kernel: the padded fit is exact, the segmented one is not
    truth = LoraPerfModel(kernel="padded", decode=LinearFit(alpha_s=1e-5, gamma_s=1e-3, beta_s=2e-3),
                          prefill=LinearFit(alpha_s=1e-7, gamma_s=1e-4, beta_s=3e-3))
    batches = [(8,) * 4, (8, 64), (64,) * 4, (8, 8, 8, 64), (16,) * 8, (8,) * 8 + (64,), (32, 0), (0, 0, 64)]
    decode = [DecodeSample(ranks=b, seconds=truth.decode_s(b)) for b in batches]
    prompts = [((32, 8),), ((32, 64),), ((64, 8), (64, 64)), ((128, 16),), ((16, 8),) * 4, ((64, 32), (16, 8))]
    prefill = [PrefillSample(prompts=p, seconds=truth.prefill_s(p)) for p in prompts]
    padded, segmented = fit_model("padded", decode, prefill), fit_model("segmented", decode, prefill)
    assert padded.decode.r2 == pytest.approx(1.0) and padded.prefill.r2 == pytest.approx(1.0)
    assert segmented.decode.r2 < 0.99
    assert padded.decode_s((16, 64)) == pytest.approx(truth.decode_s((16, 64)))


def test_profile_round_trips_and_bad_files_name_the_field() -> None:
    data = encode_profile(PAPER_PROFILE)
    assert decode_profile(data) == PAPER_PROFILE
    with pytest.raises(ValueError, match=r"lora.json: .*kernel"):
        decode_profile(b'{"padded": {"kernel": "bgmv", "decode": {"alpha_s": 1}, "prefill": {"alpha_s": 1}}}',
                       source="lora.json")
    with pytest.raises(ValueError, match="no model for the 'segmented' kernel"):
        LoraPerfProfile(name="x").model("segmented")
    toml = b'name = "t"\n[padded]\nkernel = "padded"\n[padded.decode]\nalpha_s = 1e-5\n[padded.prefill]\nalpha_s = 0.0\n'
    assert decode_profile(toml, toml=True).model("padded").decode.alpha_s == 1e-5
