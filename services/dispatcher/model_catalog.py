"""Which models and adapters exist, and each model's context length (pure).

Two sources, merged: the cluster config (`[[models]]`, `[[adapters]]`: known from the first
moment, even while the registry is down) and the registry catalog (`ModelRecord`,
`AdapterRecord`, written by the workers that load them: authoritative for max_context).
A model some live instance serves is known even if neither source names it. An adapter deleted
from the registry (`POST /v1/unload_lora_adapter`) is unknown even if the config names it.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.config import ClusterConfig
from shared.events import AdapterRecord, ModelRecord


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # a SubmitRejectReason
    message: str


class ModelCatalog:
    def __init__(self) -> None:
        self._config_models: dict[str, int] = {}  # name -> max_context
        self._config_adapters: dict[str, str] = {}  # name -> base
        self._registry_models: dict[str, int] = {}
        self._registry_adapters: dict[str, str] = {}
        self._unloaded: set[str] = set()  # deleted from the registry (unloaded): the config no longer counts
        self._sizes: dict[str, tuple[int, int]] = {}  # adapter -> (rank, bytes; 0: unknown), for rank-aware routing

    @classmethod
    def from_config(cls, cfg: ClusterConfig) -> "ModelCatalog":
        catalog = cls()
        catalog._config_models = {m.name: m.max_context for m in cfg.models}
        catalog._config_adapters = {a.name: a.base for a in cfg.adapters}
        catalog._sizes = {a.name: (a.rank, 0) for a in cfg.adapters}
        return catalog

    def put_model(self, record: ModelRecord) -> None:
        self._registry_models[record.name] = record.max_context

    def delete_model(self, name: str) -> None:
        self._registry_models.pop(name, None)

    def put_adapter(self, record: AdapterRecord) -> None:
        self._registry_adapters[record.name] = record.base
        self._unloaded.discard(record.name)
        self._sizes[record.name] = (record.rank, record.bytes)

    def delete_adapter(self, name: str) -> None:
        self._registry_adapters.pop(name, None)
        self._unloaded.add(name)

    def adapter_size(self, adapter: str) -> tuple[int, int]:
        """(LoRA rank, device bytes) of an adapter; 0 where unknown."""
        return self._sizes.get(adapter, (0, 0))

    def max_context(self, model: str) -> int | None:
        return self._registry_models.get(model, self._config_models.get(model))

    def base_of(self, adapter: str) -> str | None:
        if adapter in self._unloaded:
            return None
        return self._registry_adapters.get(adapter, self._config_adapters.get(adapter))

    def check(self, model: str, adapter: str | None, prompt_tokens: int, max_tokens: int,
              served: set[str]) -> Refusal | None:
        """None when the request names a known model (and adapter of it) and fits its context."""
        known = model in self._registry_models or model in self._config_models or model in served
        if not known:
            return Refusal("model_not_found", f"the model {model!r} does not exist")
        if adapter is not None:
            base = self.base_of(adapter)
            if base is None:
                return Refusal("model_not_found", f"the adapter {adapter!r} does not exist")
            if base != model:
                return Refusal("model_not_found", f"the adapter {adapter!r} belongs to {base!r}, not {model!r}")
        limit = self.max_context(model)
        if limit is not None and prompt_tokens + max_tokens > limit:
            return Refusal(
                "context_length_exceeded",
                f"this model's maximum context length is {limit} tokens; the request has {prompt_tokens} prompt "
                f"tokens and asks for {max_tokens} more ({prompt_tokens + max_tokens} in all)",
            )
        return None
