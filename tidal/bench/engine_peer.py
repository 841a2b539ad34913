"""llama.cpp as the single-stream bench's peer (engine_itl.py): greedy decode on a GGUF, per-token times.

Two ways to llama.cpp; the first one installed is used:

- node-llama-cpp (npm), whose `@node-llama-cpp/linux-x64` package ships llama.cpp prebuilt for x86_64
  Linux (glibc >= 2.34), one libggml-cpu per CPU family chosen at load: no compiler, no source build.
  Installed into `tidal/bench/llamacpp_node/` (`npm install --prefix tidal/bench/llamacpp_node
  --omit=optional`, ~30 s, 85 MB; `TIDAL_LLAMACPP_NODE` names another folder), driven by its
  `peer.mjs`: one node process per thread count, kept for the run, `sequence.evaluate(ids,
  {temperature: 0})`, the time between the tokens it yields.
- llama-cpp-python (pip extra `bench-llamacpp`): its `Llama.generate` with top_k 1. PyPI has no wheel
  for it here, so pip builds llama.cpp from source (over an hour on 2 busy cores).

`make_peer` returns None when neither is installed; `peer_name` says which one (or None).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Protocol

INSTALL_HINT = ("npm install --prefix tidal/bench/llamacpp_node --omit=optional "
                "(node >= 20; prebuilt llama.cpp, ~30 s)")


def node_dir() -> Path:
    return Path(os.environ.get("TIDAL_LLAMACPP_NODE") or Path(__file__).parent / "llamacpp_node")


def _node_version() -> str | None:
    """node-llama-cpp's version where node and the package are installed, else None."""
    pkg = node_dir() / "node_modules" / "node-llama-cpp" / "package.json"
    if shutil.which("node") is None or not pkg.is_file() or not (node_dir() / "peer.mjs").is_file():
        return None
    return str(json.loads(pkg.read_text()).get("version", "?"))


class Peer(Protocol):
    """`run` returns the seconds between consecutive tokens; `cpu` then holds the CPU seconds the
    peer's process (all its threads) used between them, where it can say (else empty)."""

    cpu: list[float]

    def run(self, prompt: list[int], output: int) -> list[float]: ...

    def close(self) -> None: ...


def _stamps_to_itl(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


class NodePeer:
    """node-llama-cpp's prebuilt llama.cpp in a node process (llamacpp_node/peer.mjs), JSON lines over pipes."""

    def __init__(self, gguf: Path, threads: int, context: int) -> None:
        self.proc = subprocess.Popen(["node", str(node_dir() / "peer.mjs"), str(gguf), str(threads), str(context)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=node_dir())
        self.cpu: list[float] = []
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"llama.cpp peer did not start: {ready}")

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited (rc {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def run(self, prompt: list[int], output: int) -> list[float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": list(prompt), "output": output}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.cpu = [ms / 1000 for ms in reply.get("cpu_ms", [])]
        return [ms / 1000 for ms in reply["itl_ms"]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LlamaCppPythonPeer:
    """llama-cpp-python's `Llama.generate` (top_k 1), timed between the tokens it yields."""

    def __init__(self, gguf: Path, threads: int, context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                         n_batch=min(context, 512), verbose=False)
        self.cpu: list[float] = []

    def run(self, prompt: list[int], output: int) -> list[float]:
        stamps: list[float] = []
        cpu: list[float] = []  # this process's CPU: ours is idle meanwhile
        for _token in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                        reset=True):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            if len(stamps) == output:
                break
        self.cpu = _stamps_to_itl(cpu)
        return _stamps_to_itl(stamps)

    def close(self) -> None:
        self.llm.close()


def peer_name() -> str | None:
    """'node-llama-cpp X (prebuilt llama.cpp)', 'llama-cpp-python X', or None when neither is installed."""
    version = _node_version()
    if version is not None:
        return f"node-llama-cpp {version} (prebuilt llama.cpp)"
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        return f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}"
    return None


def make_peer(gguf: Path, threads: int, context: int) -> Peer | None:
    if _node_version() is not None:
        return NodePeer(gguf, threads, context)
    if importlib.util.find_spec("llama_cpp") is not None:
        return LlamaCppPythonPeer(gguf, threads, context)
    return None
