"""The subject catalog: every NATS subject Tidal uses, as data. One source of truth.

For each subject: its template (versioned `tidal.v1.…`, `<token>` for a variable token), its
pattern (pub/sub or request/reply, and the queue group if any), the payload and reply
message types, who publishes (for request/reply: who sends requests) and who listens
(who answers), and one line of description. Read by the services (through the builder
functions below), by `tidal schemas` (schemas/SUBJECTS.md and subjects.json) and by the
NATS permission generator for compose/ (shared.nats_permissions).

Every request/reply subject may also answer `shared.wire.ErrorReply` (flagged by the
`tidal-error` header) for a malformed message, an expired deadline or a responder failure.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import cached_property, reduce
from operator import or_
from typing import Any, Final
from urllib.parse import unquote

from shared import events as ev
from shared.health import HealthReply, HealthRequest
from shared.wire import ErrorReply

PREFIX: Final = "tidal.v1"

SERVICES: Final = ("gateway", "dispatcher", "planner", "predictor", "registry", "gpu_worker")
# NATS users that are not Tidal services: the `tidal` CLI (status, up) and external schedulers.
EXTERNAL_ROLES: Final = ("cli", "scheduler")
ROLES: Final = SERVICES + EXTERNAL_ROLES
ALL_SERVICES: Final = frozenset(SERVICES)
NON_REGISTRY: Final = ALL_SERVICES - {"registry"}


class Pattern(enum.StrEnum):
    PUBSUB = "pub/sub"
    REQUEST = "request/reply"


_TOKEN = re.compile(r"<([a-z_]+)>")
_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")


def subject_token(value: str) -> str:
    """`value` as one subject token: characters other than [A-Za-z0-9_-] are percent-encoded.

    Ids are already token-safe (left as they are); a model name's '.' becomes '%2E'.
    """
    if _ALL_SAFE.fullmatch(value):
        return value  # the common case: ids are token-safe by construction
    if not value:
        raise ValueError("a subject token cannot be empty")
    return "".join(ch if _SAFE.fullmatch(ch) else "".join(f"%{b:02X}" for b in ch.encode()) for ch in value)


def parse_subject_token(token: str) -> str:
    """Inverse of subject_token."""
    return unquote(token, errors="strict")


@dataclass(frozen=True)
class Subject:
    key: str  # stable name in this catalog, e.g. "worker.assign"
    template: str  # e.g. "tidal.v1.worker.<worker_id>.assign"
    pattern: Pattern
    payload: tuple[type, ...]  # message types a listener accepts (a tagged union when several)
    publishers: frozenset[str]  # roles that publish (request/reply: that send requests)
    listeners: frozenset[str]  # roles that subscribe (request/reply: that answer)
    description: str
    reply: tuple[type, ...] = ()  # request/reply: the reply types (besides ErrorReply)
    queue_group: str | None = None  # listeners share the work in this queue group
    stable: bool = True  # False: provisional, later issues will extend it

    def __post_init__(self) -> None:
        if not self.template.startswith(PREFIX + "."):
            raise ValueError(f"{self.key}: subject {self.template!r} is not under {PREFIX}")
        if (self.pattern is Pattern.REQUEST) != bool(self.reply):
            raise ValueError(f"{self.key}: a request/reply subject (only) declares reply types")
        unknown = (self.publishers | self.listeners) - set(ROLES)
        if unknown:
            raise ValueError(f"{self.key}: unknown roles {sorted(unknown)}")

    @cached_property
    def tokens(self) -> tuple[str, ...]:
        """Names of the variable tokens, in order."""
        return tuple(_TOKEN.findall(self.template))

    @cached_property
    def wildcard(self) -> str:
        """The subscription/permission form: every variable token is '*'."""
        return _TOKEN.sub("*", self.template)

    @cached_property
    def payload_type(self) -> Any:
        """The type to decode the payload as (a union when the subject carries several)."""
        return reduce(or_, self.payload)

    @cached_property
    def reply_type(self) -> Any:
        return reduce(or_, self.reply) if self.reply else None

    def subject(self, **tokens: str) -> str:
        """A concrete subject: `CATALOG['worker.assign'].subject(worker_id='cpu-0')`."""
        if set(tokens) != set(self.tokens):
            raise TypeError(f"{self.key} takes tokens {self.tokens}, got {sorted(tokens)}")
        return _TOKEN.sub(lambda m: subject_token(tokens[m.group(1)]), self.template)

    def match(self, subject: str) -> dict[str, str] | None:
        """The tokens of a concrete subject of this kind, or None if it is not one."""
        want, got = self.template.split("."), subject.split(".")
        if len(want) != len(got):
            return None
        found: dict[str, str] = {}
        for w, g in zip(want, got):
            name = _TOKEN.fullmatch(w)
            if name:
                found[name.group(1)] = parse_subject_token(g)
            elif w != g:
                return None
        return found


# The commands of the `worker.adapters` subject (the only worker commands the gateway may send).
ADAPTER_COMMANDS: Final = (ev.ctl.LoadAdapter, ev.ctl.EvictAdapter, ev.ctl.OffloadAdapter)


def _subjects() -> list[Subject]:
    S, P, R = Subject, Pattern.PUBSUB, Pattern.REQUEST
    worker_readers = frozenset({"dispatcher", "planner", "scheduler"})
    catalog = [
        S("dispatch.submit", f"{PREFIX}.dispatch.submit", R, (ev.SubmitRequest,),
          frozenset({"gateway"}), frozenset({"dispatcher"}),
          "Submit one generation; answered once admitted or refused. Subscribe to `req.<request_id>.out` first.",
          reply=(ev.SubmitAccepted, ev.SubmitRejected), queue_group="dispatcher"),
        S("dispatch.stats", f"{PREFIX}.evt.dispatch.stats", P, (ev.DispatchStats,),
          frozenset({"dispatcher"}), frozenset({"predictor", "planner", "scheduler"}),
          "Per-model arrivals, admissions and queues of one dispatcher, every stats interval."),
        S("worker.assign", f"{PREFIX}.worker.<worker_id>.assign", R, (ev.Assignment,),
          frozenset({"dispatcher", "gpu_worker"}), frozenset({"gpu_worker"}),
          "Hand one request to an instance on this worker (idempotent per key); tokens go to `req.<request_id>.out`. "
          "Workers send it to each other to hand over a migrated request (with `kv_computed_tokens` in KV mode).",
          reply=(ev.AssignAccepted, ev.AssignRejected)),
        S("worker.ctl", f"{PREFIX}.worker.<worker_id>.ctl", R, ev.ctl.CTL_COMMANDS,
          frozenset({"planner", "scheduler"}), frozenset({"gpu_worker"}),
          "Control command to one worker: load/evict, drop/restore layers, prewarm, groups, migration.",
          reply=(ev.CtlDone, ev.CtlRefused), stable=False),
        # The adapter commands alone, on their own subject: the internet-facing gateway may send these (its
        # runtime LoRA routes) and nothing else, so its credentials cannot evict a model, form a group or move
        # a request (NATS refuses it `worker.ctl`; the worker decodes only adapter commands here).
        S("worker.adapters", f"{PREFIX}.worker.<worker_id>.adapters", R, ADAPTER_COMMANDS,
          frozenset({"gateway", "planner", "scheduler"}), frozenset({"gpu_worker"}),
          "Register, unregister or offload a LoRA adapter on one worker (LoadAdapter, EvictAdapter, "
          "OffloadAdapter); the same commands are also taken on `worker.ctl`.",
          reply=(ev.CtlDone, ev.CtlRefused), stable=False),
        S("worker.migrate", f"{PREFIX}.worker.<worker_id>.migrate", R, ev.ctl.MIGRATE_MESSAGES,
          frozenset({"gpu_worker"}), frozenset({"gpu_worker"}),
          "Worker to worker, a KV migration's source to its destination: reserve blocks (MigrateIn), expect a "
          "pre-copy stage's data-plane transfer (MigrateKvStage), release them (MigrateKvCancel).",
          reply=(ev.CtlDone, ev.CtlRefused), stable=False),
        S("worker.stats", f"{PREFIX}.evt.worker.stats", P, (ev.WorkerStats,),
          frozenset({"gpu_worker"}), worker_readers | {"cli", "gateway", "gpu_worker", "predictor"},  # cli: `tidal
          # status` shows the pools; gateway: /v1/models shows where adapters are warm; gpu_worker: a buddy-group
          # member sees its peers join and leave; predictor: each model's requests in the system (concurrency)
          "Memory pool by kind, instances' batch/queue/KV use and growth, resident adapters (every 250 ms)."),
        S("worker.heartbeat", f"{PREFIX}.evt.worker.heartbeat", P, (ev.WorkerHeartbeat,),
          frozenset({"gpu_worker"}), frozenset({"registry", "dispatcher", "gpu_worker"}),
          "Worker liveness; the registry marks a worker dead `registry.dead_after` after the last one. A new "
          "`incarnation` is a restarted process (buddy-group peers and KV-migration destinations act on it)."),
        S("worker.prefixes", f"{PREFIX}.evt.worker.prefixes", P, (ev.PrefixSummary,),
          frozenset({"gpu_worker"}), frozenset({"dispatcher", "scheduler", "cli"}),  # cli: `tidal bench prefix`
          "Per instance: the KV block hashes it holds (prefix caching; most recent first, bounded) and its "
          "hit counters, on change at a bounded rate; the dispatcher's prefix-aware routing reads it.",
          stable=False),
        S("request.out", f"{PREFIX}.req.<request_id>.out", P, (ev.TokenChunk, ev.StreamError, ev.StreamReassigned),
          frozenset({"gpu_worker", "dispatcher"}), frozenset({"gateway", "dispatcher"}),
          "A request's token chunks (seq 0, 1, ...); the last has finish_reason and usage, or is a StreamError. "
          "Fenced by assignment: a re-dispatch's StreamReassigned (from the dispatcher) or a migration's first "
          "chunk makes an older assignment's messages at or past its seq stale."),
        S("request.abort", f"{PREFIX}.req.<request_id>.abort", P, (ev.AbortRequest,),
          frozenset({"gateway", "dispatcher", "gpu_worker"}), frozenset({"gpu_worker", "dispatcher"}),
          "Stop a request (client went away, cancelled, deadline); its worker frees the KV within one step. "
          "The dispatcher's and workers' are targeted (worker_id): a superseded copy stops, the current one goes on."),
        S("registry.get", f"{PREFIX}.registry.get", R, (ev.RegistryGet,),
          NON_REGISTRY | {"cli", "scheduler"}, frozenset({"registry"}),
          "Read one catalog record with its revision.",
          reply=(ev.CatalogEntry, ev.RegistryNotFound), queue_group="registry"),
        S("registry.list", f"{PREFIX}.registry.list", R, (ev.RegistryList,),
          NON_REGISTRY | {"cli", "scheduler"}, frozenset({"registry"}),
          "List a bucket's records with their revisions, a page at a time.",
          reply=(ev.RegistryListing,), queue_group="registry"),
        S("registry.put", f"{PREFIX}.registry.put", R, (ev.RegistryPut,),
          NON_REGISTRY, frozenset({"registry"}),
          "Create or update a record, compare-and-set on its revision (0 = create).",
          reply=(ev.RegistryWritten, ev.RegistryConflict), queue_group="registry"),
        S("registry.delete", f"{PREFIX}.registry.delete", R, (ev.RegistryDelete,),
          NON_REGISTRY, frozenset({"registry"}),
          "Delete a record, compare-and-set on its revision (every service deletes its own ServiceRecord at stop).",
          reply=(ev.RegistryDeleted, ev.RegistryConflict, ev.RegistryNotFound), queue_group="registry"),
        S("registry.changed", f"{PREFIX}.evt.registry.<bucket>", P, (ev.CatalogChanged,),
          frozenset({"registry"}), NON_REGISTRY | {"scheduler", "cli"},
          "A catalog record was written or deleted (or a worker's liveness changed); bucket: `models`, "
          "`adapters`, `workers`, `instances`, `groups`, `services`."),
        S("service.heartbeat", f"{PREFIX}.evt.service.heartbeat", P, (ev.ServiceHeartbeat,),
          ALL_SERVICES - {"gpu_worker"}, frozenset({"registry"}),
          "Liveness of a non-worker service process, registries included (workers send worker heartbeats)."),
        S("plan.event", f"{PREFIX}.evt.plan.<kind>", P, (ev.PlanDecided, ev.PlanApplied, ev.PlanFailed,
                                                          ev.PlanCancelled, ev.PlanPurchased),
          frozenset({"planner"}), frozenset({"dispatcher", "scheduler"}),
          "A plan was decided, applied, failed or cancelled (kind: `decided`, `applied`, `failed`, `cancelled`); "
          "every decided plan ends with exactly one of the other three. `purchased`: the arbiter's price list "
          "for one need and what it bought (`[planner] economy = \"arbiter\"`).", stable=False),
        S("planner.placement", f"{PREFIX}.evt.planner.placement", P, (ev.PlacementHints,),
          frozenset({"planner"}), frozenset({"dispatcher", "scheduler"}),
          "Where the planner would place new requests of a model, by KV size class (MELL's Allocate), "
          "every planner interval; the dispatcher's `mell` routing follows it until `valid_until`.",
          stable=False),
        S("planner.capacity", f"{PREFIX}.planner.capacity", R, (ev.CapacityRequest,),
          frozenset({"dispatcher"}), frozenset({"planner"}),
          "The dispatcher asks for capacity for a model it cannot place.",
          reply=(ev.CapacityReply,), queue_group="planner", stable=False),
        S("planner.purchases", f"{PREFIX}.planner.purchases", R, (ev.PurchaseLogRequest,),
          frozenset({"cli"}), frozenset({"planner"}),
          "The latest memory purchases of the planner holding the lease (only it answers); none under "
          "`[planner] economy = \"fixed-order\"`.", reply=(ev.PurchaseLogReply,), stable=False),
        S("predict.forecast", f"{PREFIX}.predict.<model>", P, (ev.Forecast,),
          frozenset({"predictor"}), frozenset({"planner", "scheduler"}),
          "Forecast of a model's average and peak load for the next window (model name token-encoded).",
          stable=False),
    ]
    for service in SERVICES:  # every instance answers its service's health (no queue group)
        catalog.append(
            S(f"health.{service}", f"{PREFIX}.{service}.health", R, (HealthRequest,),
              frozenset({"cli"}), frozenset({service}),
              f"Health of every running {service} process (state, in-flight work, metrics port).",
              reply=(HealthReply,))
        )
    return catalog


CATALOG: Final[dict[str, Subject]] = {s.key: s for s in _subjects()}
ERROR_REPLY: Final = ErrorReply

# JetStream: the registry (the durable catalog's KV buckets; everyone else reads and writes the
# catalog through the registry's request/reply API) and the predictor (its own load history).
JETSTREAM_ROLES: Final = frozenset({"registry", "predictor"})
PREDICTOR_BUCKET: Final = "tidal_predictor"  # the predictor's per-model windows (KV; docs/warmserve.md)


def kv_bucket(bucket: str) -> str:
    """The JetStream KV bucket holding a catalog bucket: `kv_bucket("models")` -> "tidal_models"."""
    return f"tidal_{ev.Bucket(bucket)}"


# --- concrete subject builders (what services publish to and subscribe on) ---
def dispatch_submit() -> str:
    return CATALOG["dispatch.submit"].template


def dispatch_stats() -> str:
    return CATALOG["dispatch.stats"].template


def worker_assign(worker_id: str) -> str:
    return CATALOG["worker.assign"].subject(worker_id=worker_id)


def worker_ctl(worker_id: str) -> str:
    return CATALOG["worker.ctl"].subject(worker_id=worker_id)


def worker_adapters(worker_id: str) -> str:
    return CATALOG["worker.adapters"].subject(worker_id=worker_id)


def worker_migrate(worker_id: str) -> str:
    return CATALOG["worker.migrate"].subject(worker_id=worker_id)


def worker_stats() -> str:
    return CATALOG["worker.stats"].template


def worker_prefixes() -> str:
    return CATALOG["worker.prefixes"].template


def worker_heartbeat() -> str:
    return CATALOG["worker.heartbeat"].template


def request_out(request_id: str) -> str:
    return CATALOG["request.out"].subject(request_id=request_id)


def request_abort(request_id: str) -> str:
    return CATALOG["request.abort"].subject(request_id=request_id)


def registry_op(op: str) -> str:
    """`registry_op("get")` -> "tidal.v1.registry.get" (op: get, list, put, delete)."""
    spec = CATALOG.get(f"registry.{op}")
    if spec is None or spec.pattern is not Pattern.REQUEST:
        raise ValueError(f"unknown registry op {op!r}: expected get, list, put or delete")
    return spec.template


def registry_changed(bucket: str) -> str:
    return CATALOG["registry.changed"].subject(bucket=str(ev.Bucket(bucket)))


def service_heartbeat() -> str:
    return CATALOG["service.heartbeat"].template


def plan_event(kind: str) -> str:
    if kind not in ev.PLAN_EVENT_KINDS:
        raise ValueError(f"unknown plan event kind {kind!r}: expected one of {sorted(ev.PLAN_EVENT_KINDS)}")
    return CATALOG["plan.event"].subject(kind=kind)


def planner_placement() -> str:
    return CATALOG["planner.placement"].template


def planner_capacity() -> str:
    return CATALOG["planner.capacity"].template


def planner_purchases() -> str:
    return CATALOG["planner.purchases"].template


def predict_forecast(model: str) -> str:
    return CATALOG["predict.forecast"].subject(model=model)


def health(service: str) -> str:
    spec = CATALOG.get(f"health.{service}")
    if spec is None:
        raise ValueError(f"unknown service {service!r}: expected one of {', '.join(SERVICES)}")
    return spec.template


def find(subject: str) -> tuple[Subject, dict[str, str]] | None:
    """The catalog entry a concrete subject belongs to, and its tokens."""
    for spec in CATALOG.values():
        tokens = spec.match(subject)
        if tokens is not None:
            return spec, tokens
    return None


def uses(role: str) -> tuple[list[Subject], list[Subject]]:
    """(subjects `role` publishes or requests on, subjects it subscribes to or answers)."""
    return (
        [s for s in CATALOG.values() if role in s.publishers],
        [s for s in CATALOG.values() if role in s.listeners],
    )
