"""HTTP bodies of the runtime LoRA routes (`routes_adapters.py`): vLLM's request bodies, Tidal's answer.

Like the other `api_*.py` modules these Structs are the wire format and the OpenAPI spec.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from litestar.openapi import ResponseSpec
from msgspec import Meta

from services.gateway.api_common import ErrorResponse


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=256, description="The name requests will use as `model`.")]
    lora_path: Annotated[str, Meta(min_length=1, max_length=4096, description="A PEFT directory the workers can read.")]
    base_model_name: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    pinned: Annotated[bool, Meta(description="Keep it on every worker's device: never evicted by LRU.")] = False


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: Annotated[str, Meta(min_length=1, max_length=256)]


class WorkerFailure(msgspec.Struct, kw_only=True):
    worker_id: str
    error: str


class LoraAdapterResult(msgspec.Struct, kw_only=True):
    """What changed: `workers` applied it, `failed` did not (each with why)."""

    object: Literal["lora_adapter"] = "lora_adapter"
    id: str
    parent: str  # the base model
    message: str  # vLLM's success text
    workers: list[str] = []
    failed: list[WorkerFailure] = []


def _spec(description: str) -> ResponseSpec:
    return ResponseSpec(ErrorResponse, description=description, generate_examples=False)


COMMON = {
    401: _spec("Missing or wrong API key (`invalid_api_key`)"),
    413: _spec("Request body over the gateway's limit (`request_too_large`)"),
    415: _spec("A body declared as anything but `application/json` (`unsupported_media_type`)"),
    429: _spec("API key over its rate limit (`rate_limit_exceeded`)"),
    500: _spec("Internal error (`internal_error`); details only in the gateway's log"),
}
LOAD_RESPONSES = {
    200: ResponseSpec(LoraAdapterResult, description="Registered by at least one worker", generate_examples=False),
    400: _spec("Bad body, name, path, rank or base model, or every worker refused the adapter "
               "(`invalid_request_error`, naming `param`)"),
    404: _spec("Runtime LoRA updates are disabled (`not_found`)"),
    409: _spec("An adapter of that name is already loaded (`adapter_already_loaded`)"),
    503: _spec("Draining (`draining`), the catalog not loaded yet (`no_capacity`), or no live worker serving the "
               "base model could load it (`model_unavailable`)"),
    **COMMON,
}
UNLOAD_RESPONSES = {
    200: ResponseSpec(LoraAdapterResult, description="Removed from the catalog; the workers drop it once its running "
                      "requests finish", generate_examples=False),
    400: _spec("Bad body, or the name is a base model (`invalid_request_error`)"),
    404: _spec("No such adapter (`model_not_found`), or runtime LoRA updates are disabled (`not_found`)"),
    409: _spec("The adapter changed while it was being unloaded (`conflict`); retry"),
    503: _spec("Draining (`draining`), or the registry or catalog is not reachable (`no_capacity`)"),
    **COMMON,
}


__all__ = ["LOAD_RESPONSES", "LoadLoraAdapterRequest", "LoraAdapterResult", "UNLOAD_RESPONSES",
           "UnloadLoraAdapterRequest", "WorkerFailure"]
