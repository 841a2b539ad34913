"""The predictor's history in JetStream: one KV bucket (`tidal_predictor`) so a restart loses nothing.

Keys: `h.<model>` holds a model's closed windows (`ModelHistory`, written when a window
closes, before its forecast is published); `open` holds the windows still filling
(`OpenWindows`, flushed every second while it changes, and at shutdown). A record cut with a
different window length than the config's is left out (logged): its windows mean other things.
"""
from __future__ import annotations

from shared.bus import Bus
from shared.kv import KVBucket
from shared.logging import get_logger
from shared.subjects import PREDICTOR_BUCKET

from services.predictor.windows import ModelHistory, OpenWindows

log = get_logger("tidal.predictor")

HISTORY_PREFIX = "h."
OPEN_KEY = "open"


class HistoryStore:
    def __init__(self, bus: Bus, *, replicas: int = 1) -> None:
        self.bus = bus
        self.replicas = replicas
        self._histories: KVBucket[ModelHistory] | None = None
        self._open: KVBucket[OpenWindows] | None = None

    async def open(self) -> None:
        # two typed views of one bucket: a key's value type follows from its name
        about = "tidal predictor: load per model and window"
        self._histories = await self.bus.kv(PREDICTOR_BUCKET, ModelHistory, replicas=self.replicas, description=about)
        self._open = await self.bus.kv(PREDICTOR_BUCKET, OpenWindows, replicas=self.replicas, description=about)

    async def load(self, window_s: float) -> tuple[dict[str, ModelHistory], OpenWindows | None]:
        assert self._histories is not None and self._open is not None
        histories: dict[str, ModelHistory] = {}
        opened: OpenWindows | None = None
        for key in await self._histories.keys():
            try:
                if key == OPEN_KEY:
                    entry_o = await self._open.get(key)
                    opened = entry_o.value if entry_o is not None else None
                elif key.startswith(HISTORY_PREFIX):
                    entry = await self._histories.get(key)
                    if entry is None:
                        continue
                    if entry.value.window_s != window_s:
                        log.warning("history of another window length left out", key=key,
                                    stored_window_s=entry.value.window_s, window_s=window_s)
                        continue
                    histories[entry.value.model] = entry.value
            except ValueError as exc:  # an undecodable record: skip it, keep the rest
                log.warning("predictor record skipped", key=key, error=str(exc))
        return histories, opened

    async def save_history(self, history: ModelHistory) -> None:
        assert self._histories is not None
        await self._histories.put(HISTORY_PREFIX + history.model, history)

    async def save_open(self, opened: OpenWindows) -> None:
        assert self._open is not None
        await self._open.put(OPEN_KEY, opened)
