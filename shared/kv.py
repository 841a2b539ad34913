"""Typed JetStream KV buckets: values are msgspec Structs (msgpack), writes can be compare-and-set.

    models = await bus.kv("models", ModelRecord, history=5)
    rev = await models.create("llama", ModelRecord(...))          # KeyExists if present
    entry = await models.get("llama")                               # KVEntry(key, value, revision) or None
    rev = await models.update("llama", new_value, entry.revision)   # RevisionConflict if someone wrote first
    async with models.watch() as changes:                           # KVChange(op, key, revision, value)
        async for change in changes: ...

Two writers never silently overwrite each other: `update` only succeeds if the key is still at
the revision the writer read; the loser gets `RevisionConflict` naming key, expected and actual.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from shared.logging import get_logger
from shared.wire import KeyExists, RevisionConflict, encode

if TYPE_CHECKING:
    from shared.bus import Bus

T = TypeVar("T")
KEYS_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # an empty keys() from a non-empty stream, asked again
log = get_logger("tidal.kv")

_DELETE_OPS = ("DEL", "PURGE")


class KVEntry(msgspec.Struct, Generic[T], frozen=True):
    key: str
    value: T
    revision: int


class KVChange(msgspec.Struct, Generic[T], frozen=True):
    """One change seen by a watch; `value` is None for deletes."""

    op: Literal["put", "delete"]
    key: str
    revision: int
    value: T | None


class KVBucket(Generic[T]):
    """A KV bucket whose values are `value_type` Structs. `raw` is the nats-py KeyValue."""

    def __init__(self, raw: KeyValue, name: str, value_type: type[T]) -> None:
        self.raw = raw
        self.name = name
        self.value_type = value_type
        self._decoder = msgspec.msgpack.Decoder(value_type)

    def _decode(self, key: str, data: bytes | None) -> T:
        try:
            return self._decoder.decode(data or b"")
        except msgspec.MsgspecError as exc:
            raise ValueError(f"{self.name}/{key}: stored value is not a valid {self.value_type.__name__}: {exc}") from exc

    async def get(self, key: str) -> KVEntry[T] | None:
        """The current value and revision, or None when the key is absent or deleted."""
        try:
            entry = await self.raw.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return KVEntry(key=key, value=self._decode(key, entry.value), revision=int(entry.revision or 0))

    async def revision(self, key: str) -> int | None:
        """The key's current revision, None when absent or deleted."""
        try:
            entry = await self.raw.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return int(entry.revision or 0)

    async def put(self, key: str, value: T) -> int:
        """Unconditional write (last writer wins); prefer `create`/`update` for shared records."""
        return await self.raw.put(key, encode(value))

    async def create(self, key: str, value: T) -> int:
        """Write only if the key is absent (or deleted); raises KeyExists otherwise."""
        try:
            return await self.raw.create(key, encode(value))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise KeyExists(self.name, key, await self.revision(key)) from None

    async def update(self, key: str, value: T, revision: int) -> int:
        """Compare-and-set: write only if the key is still at `revision`; returns the new revision."""
        try:
            return await self.raw.update(key, encode(value), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise RevisionConflict(self.name, key, revision, await self.revision(key)) from None

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Delete (a tombstone watchers see); with `revision`, only if the key is still at it."""
        try:
            await self.raw.delete(key, last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise RevisionConflict(self.name, key, revision or 0, await self.revision(key)) from None
        except nats.js.errors.APIError as exc:
            if exc.err_code in (10071, 10164):
                raise RevisionConflict(self.name, key, revision or 0, await self.revision(key)) from None
            raise

    async def keys(self) -> list[str]:
        """All live keys (sorted); empty when the bucket is empty.

        nats-py's `keys()` decides "no keys" from the consumer's pending count at creation,
        which reads 0 for a moment after a nats-server restart while the stream recovers: an
        empty answer from a bucket whose stream holds messages is asked again, briefly (an
        all-deleted bucket, whose delete markers count as messages, costs those retries)."""
        for delay in KEYS_RETRY_DELAYS_S:
            try:
                return sorted(await self.raw.keys())
            except nats.js.errors.NoKeysError:
                if (await self.raw.status()).values == 0:
                    return []
            await asyncio.sleep(delay)
        return []

    async def items(self) -> list[KVEntry[T]]:
        """Every live entry (a snapshot, one read per key)."""
        entries = [await self.get(key) for key in await self.keys()]
        return [entry for entry in entries if entry is not None]

    def watch(self, keys: str = ">", *, include_initial: bool = True, include_history: bool = False) -> "KVWatch[T]":
        """Typed change events for `keys` (a NATS subject pattern over key names).

        With `include_initial` the current value of every key comes first; with
        `include_history` every retained revision does. Use as `async with bucket.watch() as w:`.
        """
        return KVWatch(self, keys, include_initial=include_initial, include_history=include_history)


class KVWatch(Generic[T]):
    """An async iterator of KVChange; stop it with `await watch.stop()` or `async with`."""

    def __init__(self, bucket: KVBucket[T], keys: str, *, include_initial: bool, include_history: bool) -> None:
        self.bucket = bucket
        self.keys = keys
        self.include_initial = include_initial
        self.include_history = include_history
        self._watcher: Any = None
        self.initial_done = asyncio.Event()  # set once the current values have been delivered

    async def start(self) -> "KVWatch[T]":
        self._watcher = await self.bucket.raw.watch(self.keys, include_history=self.include_history)
        return self

    async def stop(self) -> None:
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except (nats.errors.Error, nats.js.errors.Error):
                pass
            self._watcher = None

    async def __aenter__(self) -> "KVWatch[T]":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __aiter__(self) -> "KVWatch[T]":
        return self

    async def __anext__(self) -> KVChange[T]:
        if self._watcher is None:
            await self.start()
        while True:
            try:
                entry = await self._watcher.__anext__()
            except (StopAsyncIteration, AttributeError):  # stopped
                raise StopAsyncIteration from None
            if entry is None:  # end of the initial values
                self.initial_done.set()
                continue
            if not self.include_initial and not self.include_history and not self.initial_done.is_set():
                continue  # a current value from before the watch started
            if entry.operation in _DELETE_OPS:
                return KVChange(op="delete", key=entry.key, revision=int(entry.revision), value=None)
            try:
                value = self.bucket._decode(entry.key, entry.value)
            except ValueError as exc:  # a bad record must not kill the watcher
                log.warning("kv watch skipped undecodable value", bucket=self.bucket.name, key=entry.key, error=str(exc))
                continue
            return KVChange(op="put", key=entry.key, revision=int(entry.revision), value=value)


async def open_bucket(
    bus: "Bus", bucket: str, value_type: type[T], *, create: bool = True, history: int = 1, ttl_s: float | None = None,
    replicas: int = 1, storage: str = "file", description: str | None = None,
) -> KVBucket[T]:
    """Bind to `bucket`, creating it when absent (an existing bucket keeps its configuration)."""
    try:
        raw = await bus.js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            raise
        config = KeyValueConfig(
            bucket=bucket, description=description, history=history, ttl=ttl_s, replicas=replicas,
            storage=StorageType.FILE if storage == "file" else StorageType.MEMORY,
        )
        raw = await bus.js.create_key_value(config)
    return KVBucket(raw, bucket, value_type)
