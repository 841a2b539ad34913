"""`tidal profile lora`: the sweep, the real engine measured, the profile file the router loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.profiler.lora import LoraSweep, decode_batches, prefill_sets
from shared.config_loader import parse
from shared.lora_profile_file import load_lora_profile, routing_options
from shared.policy.routing_policies import make_policy
from tidal.cli import main

SMALL = ["--ranks", "8,32", "--lora-batches", "1,3", "--lora-prompts", "16", "--lora-steps", "2",
         "--lora-repeats", "1", "--hidden", "128"]


def test_sweep_has_homogeneous_and_mixed_batches() -> None:
    sweep = LoraSweep(ranks=(8, 64), batches=(1, 4), prompts=(32,), prefill_counts=(1, 2))
    assert decode_batches(sweep) == [(8,), (64,), (8,) * 4, (64,) * 4, (8, 8, 8, 64)]
    assert ((32, 8), (32, 64)) in prefill_sets(sweep) and ((32, 64), (32, 64)) in prefill_sets(sweep)


def test_profile_lora_writes_a_profile_the_router_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lora.json"
    assert main(["profile", "lora", "--out", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    assert printed.count("R^2") == 4  # decode and prefill, both kernels
    profile = load_lora_profile(out)
    for kernel in ("padded", "segmented"):
        model = profile.model(kernel)  # type: ignore[arg-type]
        assert model.decode.points == 5 and model.prefill.points == 5
        assert model.decode.r2 is not None and model.decode.r2 <= 1.0
        assert model.decode_s([8, 32]) > 0
    toml = (f'[dispatcher]\nrouting_policy = "rank_aware"\nlora_profile = "{out}"\n'
            '[policies]\nlora_kernel = "padded"\n[slo]\ntpot = "2x"\n')
    cfg = parse(toml, source="test.toml", base_dir=tmp_path, env={})
    options = routing_options(cfg)
    assert options.kernel == "padded" and options.slo_factor == 2.0 and options.tpot_slo_s is None
    policy = make_policy(cfg.dispatcher.routing_policy.replace("_", "-"), options=options)
    assert policy.model == profile.model("padded")  # type: ignore[attr-defined]
    assert policy.slo_s == pytest.approx(2 * profile.model("padded").decode_s([0]))  # type: ignore[attr-defined]

def test_bad_arguments_and_files_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "lora", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "lora", "--kernels", "bgmv"])
    with pytest.raises(ValueError, match="cannot read"):
        load_lora_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"segmented": {"kernel": "segmented"}}')
    with pytest.raises(ValueError, match=r"bad.json: .*decode"):
        load_lora_profile(tmp_path / "bad.json")
