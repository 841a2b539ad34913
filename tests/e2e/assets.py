"""Tiny checkpoints for the end-to-end suite, and the oracle: the engine run in-process on them.

Two models (a llama- and a qwen2-layout one) and a LoRA adapter of the llama one, generated
once per test session (`make_model` / `make_lora`: random weights, a real trained tokenizer).
The oracle loads the same checkpoints into an in-process `LLMEngine` configured as the
workers configure theirs; its greedy outputs are what the cluster must return.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

LLAMA = "tiny-llama"
QWEN = "tiny-qwen"
LORA = "tiny-llama-lora"
MAX_CONTEXT = 1024
BLOCK_TOKENS = 16
STEP_TOKEN_BUDGET = 512


@dataclass(frozen=True)
class TinyAssets:
    root: Path

    @property
    def models(self) -> dict[str, Path]:
        return {LLAMA: self.root / LLAMA, QWEN: self.root / QWEN}

    @property
    def adapters(self) -> dict[str, tuple[str, Path]]:
        return {LORA: (LLAMA, self.root / LORA)}


def make_assets(root: Path) -> TinyAssets:
    """Generate the checkpoints under `root` (a second call with the same root reuses them)."""
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    assets = TinyAssets(root)
    shapes = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position=MAX_CONTEXT)
    for name, arch, seed in ((LLAMA, "llama", 1), (QWEN, "qwen2", 2)):
        if not (root / name / "config.json").is_file():
            make_model(root / name, arch=arch, seed=seed, **shapes)  # type: ignore[arg-type]
    base, path = assets.adapters[LORA]
    if not (path / "adapter_config.json").is_file():
        make_lora(path, assets.models[base], rank=4, targets=["q", "v"], seed=3)
    return assets


@dataclass(frozen=True)
class Expected:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int


class Oracle:
    """Fault-free greedy completions from the in-process engine (one engine per model, cached)."""

    def __init__(self, assets: TinyAssets, *, max_batch: int = 8) -> None:
        self.assets = assets
        self.max_batch = max_batch
        self._engines: dict[str, object] = {}
        self._results: dict[tuple[object, ...], Expected] = {}
        self._lock = threading.Lock()  # tests may ask from several threads

    def _engine(self, model: str):  # type: ignore[no-untyped-def]
        from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

        engine = self._engines.get(model)
        if engine is None:
            engine = LLMEngine(EngineConfig(
                model_dir=str(self.assets.models[model]), pool_bytes=64 << 20, block_size=BLOCK_TOKENS,
                max_num_seqs=self.max_batch, max_num_batched_tokens=STEP_TOKEN_BUDGET, max_model_len=MAX_CONTEXT,
                dtype="float32", num_threads=1,
            ))
            for name, (base, path) in self.assets.adapters.items():
                if base == model:
                    engine.add_lora(name, str(path))
            self._engines[model] = engine
        return engine

    def prompt_ids(self, model: str, prompt: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
        tok = self._engine(model).tokenizer
        return tok.encode_chat(messages) if messages is not None else tok.encode(prompt or "")

    def greedy(self, model: str, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
               max_tokens: int = 16, adapter: str | None = None, ignore_eos: bool = False) -> Expected:
        from services.gpu_worker.engine.sampling_params import SamplingParams

        key = (model, prompt, repr(messages), max_tokens, adapter, ignore_eos)
        with self._lock:
            if key not in self._results:
                ids = self.prompt_ids(model, prompt, messages)
                (result,) = self._engine(model).generate(
                    [ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                    adapters=[adapter])
                self._results[key] = Expected(tuple(result.token_ids), result.text, result.finish_reason or "",
                                              len(ids))
            return self._results[key]

    def long_prompts(self, model: str, count: int, max_tokens: int) -> list[str]:
        """`count` prompts whose greedy completion runs the full `max_tokens` (no early EOS)."""
        found: list[str] = []
        for i in range(200):
            prompt = f"Story number {i}: once upon a time"
            if self.greedy(model, prompt=prompt, max_tokens=max_tokens).finish_reason == "length":
                found.append(prompt)
                if len(found) == count:
                    return found
        raise AssertionError(f"fewer than {count} prompts of {model} run {max_tokens} tokens without EOS")

    @cached_property
    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
