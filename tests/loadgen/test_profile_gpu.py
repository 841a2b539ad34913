"""`tidal profile gpu --device cpu --quick`: the same command the GPU run uses writes a profile
whose every field says how it was obtained, that `--profile FILE` loads, and whose step fits
reproduce the measured points they were fitted to."""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from loadgen.profiler.gpu_profile_build import FIT_TOLERANCE
from loadgen.sim.profile import CostProfile, StepCost, load_profile
from loadgen.sim.profile_sources import SOURCE_KINDS, count_sources
from tests.gguf_assets import smollm_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    smollm = smollm_checkpoint(tmp_path_factory)
    out = tmp_path_factory.mktemp("profile-gpu") / "cpu.json"
    done = subprocess.run([sys.executable, "-m", "tidal", "profile", "gpu", "--device", "cpu", "--quick",
                           "--smollm", str(smollm), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def _errors(cost: StepCost, points) -> list[float]:  # type: ignore[no-untyped-def]
    return [abs(cost.step_s(p.decode_seqs, p.decode_ctx, p.prefill_tokens, p.prefill_attn) - p.seconds) / p.seconds
            for p in points]


@pytest.mark.slow
def test_profile_schema_and_sources(measured: tuple[Path, str]) -> None:
    out, stdout = measured
    strict = msgspec.json.decode(out.read_bytes(), type=CostProfile)  # unknown keys would raise
    profile = load_profile(out)  # validated as `tidal sim --profile FILE` reads it
    assert profile == strict and profile.device is not None
    assert set(profile.models) == {"smollm2-135m", "llama-8b"} and profile.step == profile.models["llama-8b"]
    for prefix in ("step", "models.smollm2-135m", "models.llama-8b"):
        for name in StepCost.__struct_fields__:
            assert profile.sources[f"{prefix}.{name}"].kind == "measured", (prefix, name)
    for key in ("links.h2d.bandwidth_bytes_per_s", "links.d2h-pageable.bandwidth_bytes_per_s",
                "links.kv-copy.bandwidth_bytes_per_s", "device.weights_load_s", "device.engine_start_s",
                "device.adapter_load_s", "worker.adapter_load_s"):
        assert profile.sources[key].kind == "measured" and profile.sources[key].method, key
    assert "memcpy" in profile.sources["links.h2d.bandwidth_bytes_per_s"].method  # a CPU says what it timed
    assert profile.sources["device.graph_capture_s"].kind == "unmeasured" and profile.device.graph_capture_s is None
    assert profile.sources["request_overhead_s"].kind == "cited"
    assert all(s.kind in SOURCE_KINDS for s in profile.sources.values())
    d = profile.device
    assert d.adapter_bytes == 96 << 20  # 32 layers x q,k,v x rank 64 x hidden 4096 x (A, B) x bf16
    assert min(d.h2d_pinned_bytes_per_s, d.d2h_pageable_bytes_per_s, d.kv_block_copy_bytes_per_s) > 0
    assert d.weights_load_s > 0 and d.engine_start_s > 0 and d.adapter_load_s > 0
    assert profile.link(profile.movement.host_link).bandwidth_bytes_per_s == d.h2d_pinned_bytes_per_s
    assert "1 of 32 layers" in d.fits["llama-8b"].geometry  # the reduced CPU geometry is said
    fields, n_measured = count_sources(profile.sources)
    assert stdout.strip().splitlines()[-1].startswith(f"profile gpu: fields={fields} measured={n_measured} ")


@pytest.mark.slow
def test_fit_reproduces_the_measured_points(measured: tuple[Path, str]) -> None:
    profile = load_profile(measured[0])
    assert profile.device is not None
    for name, fit in profile.device.fits.items():
        points = fit.points
        assert sum(p.decode_seqs > 0 for p in points) >= 4 and sum(p.prefill_tokens > 0 for p in points) >= 2
        errors = _errors(profile.models[name], points)
        assert statistics.median(errors) == pytest.approx(fit.median_error, rel=1e-6, abs=1e-12)
        assert max(errors) == pytest.approx(fit.max_error, rel=1e-6, abs=1e-12)
        assert fit.median_error <= FIT_TOLERANCE["cpu"], (name, fit.median_error, points)
