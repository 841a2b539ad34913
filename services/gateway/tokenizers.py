"""Each served model's tokenizer, loaded once (off the event loop) from its checkpoint directory.

The directory is the one the registry's ModelRecord names; when that path does not exist on
the gateway's host, the cluster config's path for the model (or its generated demo directory,
`<data_dir>/models/<name>`) is tried. Only `tokenizer.json` / `tokenizer_config.json` /
`generation_config.json` and the chat templates (`chat_template.jinja`,
`additional_chat_templates/`) are read — no weights, no torch.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable, TypeVar

from services.gateway.errors import ApiError
from services.gpu_worker.engine.tokenizer import EngineTokenizer
from shared.config import ClusterConfig
from shared.events.registry import ModelRecord
from shared.logging import get_logger

log = get_logger("tidal.gateway.tokenizers")
T = TypeVar("T")


class Tokenizer:
    """A loaded tokenizer plus the per-token strings logprobs need (cached as they are asked for)."""

    def __init__(self, engine: EngineTokenizer, directory: Path) -> None:
        self.engine = engine
        self.directory = directory
        self.vocab_size = engine.vocab_size
        self._pieces: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        if tools:
            return self.engine.encode_chat(messages, add_generation_prompt, tools=tools)
        return self.engine.encode_chat(messages, add_generation_prompt)

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """The text of one token on its own (as OpenAI's logprobs show it)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.engine.decode([token_id], skip_special_tokens=False)
        return text


INLINE_CHARS = 16_384  # longer prompts are tokenized on a thread, so other streams are not held up


async def offload(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` inline when the text is short, else on a worker thread (the tokenizer's Rust code
    releases the GIL while encoding)."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def config_dirs(cfg: ClusterConfig) -> dict[str, Path]:
    """Model name -> checkpoint directory, as the cluster config names it."""
    out: dict[str, Path] = {}
    for spec in cfg.models:
        out[spec.name] = Path(spec.path) if spec.path else Path(cfg.cluster.data_dir) / "models" / spec.name
    return out


class TokenizerCache:
    def __init__(self, fallback_dirs: dict[str, Path] | None = None) -> None:
        self.fallback_dirs = fallback_dirs or {}
        self._loaded: dict[tuple[str, str], Tokenizer] = {}
        self._loading: dict[tuple[str, str], asyncio.Future[Tokenizer]] = {}

    def _directory(self, model: ModelRecord) -> Path:
        path = Path(model.path)
        if (path / "tokenizer.json").is_file():
            return path
        fallback = self.fallback_dirs.get(model.name)
        if fallback is not None and (fallback / "tokenizer.json").is_file():
            return fallback
        return path

    async def get(self, model: ModelRecord) -> Tokenizer:
        key = (model.name, model.path)
        found = self._loaded.get(key)
        if found is not None:
            return found
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(self._load(model))
        try:
            tok = await asyncio.shield(pending)
        finally:
            if pending.done():
                self._loading.pop(key, None)
        self._loaded[key] = tok
        return tok

    async def _load(self, model: ModelRecord) -> Tokenizer:
        directory = self._directory(model)
        try:
            engine = await asyncio.to_thread(EngineTokenizer.from_dir, directory)
        except Exception as exc:  # TokenizerError, OSError, or the Rust library's own errors
            log.error("tokenizer not loadable", model=model.name, directory=str(directory), error=str(exc))
            raise ApiError.unavailable(
                "model_unavailable", f"The tokenizer of model '{model.name}' cannot be loaded by the gateway.", 5.0,
            ) from None
        log.info("tokenizer loaded", model=model.name, directory=str(directory), vocab=engine.vocab_size)
        return Tokenizer(engine, directory)


__all__ = ["Tokenizer", "TokenizerCache", "config_dirs", "offload"]
