"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: vLLM's runtime LoRA API.

Load: check the PEFT directory as far as the gateway can (`peft_dir.py`), pick the base model
(`base_model_name`, else the only one served, else the one `base_model_name_or_path` names),
create the `AdapterRecord` in the registry (compare-and-set: two loads of one name cannot both
win), then send `LoadAdapter` to every live worker serving the base, all at once. A base with no
live instance: with `[dispatcher] scale_from_zero` the record alone is the answer (200, no worker:
the instance the next request starts adopts the catalog's adapters); when the planner keeps every
model up, the load waits for the instance it restarts; else 503. The answer
is 200 once at least one worker has registered it (the others are listed under `failed`); with
none, the record is deleted again and the answer says why. Unload: delete the record first (from
then on requests naming it are 404, here and at every dispatcher), then `EvictAdapter` to the
workers, which refuse new requests with it at once and drop it when its running requests end.

Both routes answer 404 `not_found` unless `[gateway] allow_runtime_lora_updating` is true
(vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). See docs/api.md.
"""
from __future__ import annotations

import asyncio
import os.path
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from services.gateway.api_adapters import (
    LOAD_RESPONSES, UNLOAD_RESPONSES, LoadLoraAdapterRequest, LoraAdapterResult, UnloadLoraAdapterRequest,
    WorkerFailure,
)
from services.gateway.catalog import ModelCatalog
from services.gateway.errors import INVALID_REQUEST, ApiError, log_failure
from services.gateway.openapi import ApiOperation
from services.gateway.peft_dir import PeftDir, PeftDirError, read_peft_dir
from services.gateway.state import GatewayState
from services.gateway.streaming import encoder
from shared.bus import Bus
from shared.events import AdapterRecord, Bucket, ModelRecord, WorkerRecord, WorkerState
from shared.events.base import NAME_PATTERN
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, EvictAdapter, LoadAdapter
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.subjects import worker_adapters
from shared.wire import DeadlineExceeded, NoResponders, RemoteError, RevisionConflict, TidalError

log = get_logger("tidal.gateway.adapters")

CTL_TIMEOUT_S = 30.0  # a worker reads the adapter from disk before it answers
REGISTRY_TIMEOUT_S = 2.0
CATALOG_WAIT_S = 2.0  # for this gateway's catalog to show the change before answering
BASE_WAIT_S = 60.0  # for a live instance of the base when the planner keeps one of each model (a restart)
_NAME = re.compile(NAME_PATTERN)


# --- the routes ----------------------------------------------------------------------------------
@post("/v1/load_lora_adapter", status_code=200, summary="Load a LoRA adapter (vLLM's runtime API)",
      tags=["adapters"], operation_class=ApiOperation, responses=LOAD_RESPONSES)
async def load_lora_adapter(request: Request[Any, Any, Any], data: JSONBody[LoadLoraAdapterRequest]) -> Response[bytes]:
    state, bus = _enabled(request)
    name = _check_name(data.lora_name)
    catalog = _loaded(state)
    if name in _models(catalog):
        raise ApiError.bad_request(f"'{name}' is the name of a base model; pick another lora_name", param="lora_name")
    if catalog.resolve(name) is not None:
        raise _already_loaded(name)
    try:
        info = await asyncio.to_thread(read_peft_dir, data.lora_path, state.config.policies.max_lora_rank)
    except PeftDirError as exc:
        raise ApiError.bad_request(str(exc)[:1024], param="lora_path") from None
    base = _base_model(catalog, data.base_model_name, info)
    workers = await _serving(catalog, base, state)
    on_start = not workers  # scale from zero: registered now, loaded by the instance a request starts
    registry = RegistryClient(bus, timeout=REGISTRY_TIMEOUT_S)
    record = AdapterRecord(name=name, base=base, path=str(info.path), rank=info.rank, targets=info.targets,
                           bytes=info.nbytes)
    try:
        await registry.create(record)
    except RevisionConflict:
        raise _already_loaded(name) from None
    except (TidalError, OSError):
        raise ApiError.unavailable("no_capacity", "The registry is not reachable; retry later.") from None
    if on_start:  # the catalog may lag an instance that is up: every worker that is not dead decides itself
        workers = _known_workers(catalog)
    key = f"lora-load-{uuid.uuid4().hex}"
    replies = await _fan_out(bus, workers, LoadAdapter(idempotency_key=key, adapter=name, base=base,
                                                       path=str(info.path), pinned=data.pinned))
    done = [w for w, r in replies.items() if isinstance(r, CtlDone)]
    failed = [WorkerFailure(worker_id=w, error=_why(r)) for w, r in replies.items() if not isinstance(r, CtlDone)
              and not (on_start and isinstance(r, CtlRefused) and r.code == "not_found")]  # not serving the base
    invalid = any(isinstance(r, CtlRefused) and r.code == "invalid" for r in replies.values())
    if not done and on_start and not invalid:  # kept: the instance a request starts adopts it
        await _until(lambda: catalog.resolve(name) is not None)
        log.info("LoRA adapter registered for a base with no instance", adapter=name, base=base)
        return _answer(LoraAdapterResult(id=name, parent=base, workers=[], failed=failed, message=(
            f"Success: LoRA adapter '{name}' added successfully. No instance of '{base}' runs now: the "
            f"next request for it or for '{base}' starts one, which loads the adapter.")))
    if not done:
        await _delete(registry, name)
        raise _load_failed(base, replies, failed)
    await _until(lambda: catalog.resolve(name) is not None)
    log.info("LoRA adapter loaded", adapter=name, base=base, path=str(info.path), rank=info.rank, workers=done,
             failed=[f"{f.worker_id}: {f.error}" for f in failed])
    return _answer(LoraAdapterResult(id=name, parent=base,
                                     message=f"Success: LoRA adapter '{name}' added successfully.",
                                     workers=done, failed=failed))


@post("/v1/unload_lora_adapter", status_code=200, summary="Unload a LoRA adapter (vLLM's runtime API)",
      tags=["adapters"], operation_class=ApiOperation, responses=UNLOAD_RESPONSES)
async def unload_lora_adapter(request: Request[Any, Any, Any],
                              data: JSONBody[UnloadLoraAdapterRequest]) -> Response[bytes]:
    state, bus = _enabled(request)
    name = data.lora_name
    catalog = _loaded(state)
    if name in _models(catalog):
        raise ApiError.bad_request(f"'{name}' is a base model, not a LoRA adapter", param="lora_name")
    if not _NAME.match(name):
        raise _adapter_not_found(name)
    registry = RegistryClient(bus, timeout=REGISTRY_TIMEOUT_S)
    try:
        entry = await registry.get(Bucket.ADAPTERS, name)
        if entry is None or not isinstance(entry.record, AdapterRecord):
            raise _adapter_not_found(name)
        if not await registry.delete(Bucket.ADAPTERS, name, entry.revision):
            raise _adapter_not_found(name)
    except RevisionConflict:
        raise ApiError(409, f"The LoRA adapter '{name}' changed while it was being unloaded; retry.",
                       type=INVALID_REQUEST, code="conflict", param="lora_name") from None
    except (TidalError, OSError):
        raise ApiError.unavailable("no_capacity", "The registry is not reachable; retry later.") from None
    base = entry.record.base
    workers = sorted({i.worker_id for i in catalog.live_instances() if i.model == base})
    replies = await _fan_out(bus, workers, EvictAdapter(idempotency_key=f"lora-unload-{uuid.uuid4().hex}",
                                                        adapter=name))
    done = [w for w, r in replies.items() if isinstance(r, CtlDone)]
    failed = [WorkerFailure(worker_id=w, error=_why(r)) for w, r in replies.items()
              if not isinstance(r, CtlDone) and not (isinstance(r, CtlRefused) and r.code == "not_found")]
    await _until(lambda: catalog.resolve(name) is None)
    log.info("LoRA adapter unloaded", adapter=name, base=base, workers=done,
             failed=[f"{f.worker_id}: {f.error}" for f in failed])
    return _answer(LoraAdapterResult(id=name, parent=base,
                                     message=f"Success: LoRA adapter '{name}' removed successfully.",
                                     workers=done, failed=failed))


# --- helpers -------------------------------------------------------------------------------------
def _known_workers(catalog: ModelCatalog) -> list[str]:
    """Workers ready or starting: one may serve the base before the catalog shows its instance, and a starting
    one that does not adopts the adapter's record when it activates."""
    records = [stored.record for stored in catalog.views[Bucket.WORKERS].entries.values()]
    return sorted(r.worker_id for r in records  # type: ignore[union-attr]
                  if isinstance(r, WorkerRecord) and r.state in (WorkerState.READY, WorkerState.STARTING))


async def _serving(catalog: ModelCatalog, base: str, state: GatewayState) -> list[str]:
    """The workers with a live instance of `base`. None: with `scale_from_zero` the adapter is registered
    for the instance a request starts ([] here); when the planner keeps every model up (`min_instances`),
    one is starting or soon will be, so wait for it; else there is nothing to wait for: 503."""
    def live() -> list[str]:
        return sorted({i.worker_id for i in catalog.live_instances() if i.model == base})

    cfg = state.config
    if live() or cfg.dispatcher.scale_from_zero:
        return live()
    if cfg.planner.enabled and cfg.planner.autoscale and cfg.planner.min_instances > 0:
        deadline = time.monotonic() + BASE_WAIT_S
        while not live() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if live():
            return live()
        raise ApiError.unavailable("model_unavailable", f"No instance of the base model '{base}' came up within "
                                   f"{BASE_WAIT_S:.0f}s (the planner keeps one of each model); retry later.")
    raise ApiError.unavailable("model_unavailable", f"No live worker serves the base model '{base}', and this "
                               "cluster starts none on demand ([dispatcher] scale_from_zero = false); retry once "
                               "a worker serves it.")


def _enabled(request: Request[Any, Any, Any]) -> tuple[GatewayState, Bus]:
    state: GatewayState = request.app.state.gateway
    if not state.config.gateway.allow_runtime_lora_updating:
        raise ApiError(404, "Runtime LoRA adapter updates are disabled on this gateway "
                            "([gateway] allow_runtime_lora_updating = false).",
                       type="not_found_error", code="not_found")
    return state, state.require_hub().bus


def _loaded(state: GatewayState) -> ModelCatalog:
    if not state.catalog.loaded.is_set():
        raise ApiError.unavailable("no_capacity", "The model catalog is not loaded yet; retry shortly.", 1.0)
    return state.catalog


def _models(catalog: ModelCatalog) -> dict[str, ModelRecord]:
    return {model.name: model for model, _ts in catalog.models()}


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ApiError.bad_request("lora_name must be 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter "
                                   "or a digit", param="lora_name")
    return name


def _base_model(catalog: ModelCatalog, named: str | None, info: PeftDir) -> str:
    models = _models(catalog)
    if named is not None:
        if named not in models:
            raise ApiError.bad_request(f"base_model_name '{named[:256]}' is not a base model of this cluster "
                                       "(see GET /v1/models)", param="base_model_name")
        return named
    if len(models) == 1:
        return next(iter(models))
    hint = info.base_hint
    matches = [m.name for m in models.values() if hint and _names_model(hint, m)]
    if len(matches) == 1:
        return matches[0]
    served = ", ".join(sorted(models)[:16]) or "none"
    raise ApiError.bad_request(f"Name the base model with base_model_name: this cluster serves {served}, and the "
                               f"adapter's base_model_name_or_path ({hint[:256]!r}) names "
                               f"{'several' if matches else 'none'} of them", param="base_model_name")


def _names_model(hint: str, model: ModelRecord) -> bool:
    if hint == model.name or hint.rstrip("/").rsplit("/", 1)[-1] == model.name:
        return True
    try:
        return os.path.realpath(hint) == os.path.realpath(model.path)
    except (OSError, ValueError):  # a NUL byte, a name too long: names nothing here
        return False


async def _fan_out(bus: Bus, workers: list[str], command: LoadAdapter | EvictAdapter) -> dict[str, CtlReply | str]:
    """The command to every worker at once: each one's reply, or why none came."""

    async def one(worker_id: str) -> CtlReply | str:
        try:
            reply: CtlReply = await bus.request(worker_adapters(worker_id), command, CtlReply, timeout=CTL_TIMEOUT_S)
            return reply
        except DeadlineExceeded:
            return f"no reply within {CTL_TIMEOUT_S:.0f}s"
        except NoResponders:
            return "not reachable"
        except RemoteError as exc:
            return f"error reply ({exc.code})"
        except Exception as exc:  # transport trouble or a bug: the others still count
            log_failure("control command failed", exc, worker_id=worker_id, command=type(command).__name__)
            return "the command could not be sent"

    outcomes = await asyncio.gather(*(one(w) for w in workers))
    return dict(zip(workers, outcomes, strict=True))


def _why(reply: CtlReply | str) -> str:
    if isinstance(reply, CtlRefused):
        return f"{reply.code}: {reply.message}"[:1024]
    return str(reply)[:1024]


def _load_failed(base: str, replies: dict[str, CtlReply | str], failed: list[WorkerFailure]) -> ApiError:
    invalid = [r for r in replies.values() if isinstance(r, CtlRefused) and r.code == "invalid"]
    if invalid:  # the adapter itself is bad (shapes, format): the client's to fix
        return ApiError.bad_request(invalid[0].message[:1024], param="lora_path")
    detail = "; ".join(f"{f.worker_id}: {f.error}" for f in failed)[:1024]
    return ApiError.unavailable("model_unavailable", f"No worker serving '{base}' could load the adapter ({detail}).")


def _already_loaded(name: str) -> ApiError:
    return ApiError(409, f"The LoRA adapter '{name}' has already been loaded.", type=INVALID_REQUEST,
                    code="adapter_already_loaded", param="lora_name")


def _adapter_not_found(name: str) -> ApiError:
    return ApiError(404, f"The LoRA adapter '{name[:256]}' cannot be found.", type=INVALID_REQUEST,
                    code="model_not_found", param="lora_name")


async def _delete(registry: RegistryClient, name: str) -> None:
    """Roll a load back (best effort: a record left behind names an adapter no worker has)."""
    try:
        entry = await registry.get(Bucket.ADAPTERS, name)
        if entry is not None:
            await registry.delete(Bucket.ADAPTERS, name, entry.revision)
    except (TidalError, OSError) as exc:
        log.warning("adapter record of a failed load not deleted", adapter=name, error=repr(exc))


async def _until(done: Callable[[], bool]) -> None:
    """Until this gateway's catalog shows the change (its watch applies the registry's event)."""
    deadline = time.monotonic() + CATALOG_WAIT_S
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _answer(result: LoraAdapterResult) -> Response[bytes]:
    return Response(encoder.encode(result), media_type="application/json")


__all__ = ["load_lora_adapter", "unload_lora_adapter"]
