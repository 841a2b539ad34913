"""Which chunk a link sends next, and how big: the transfer scheduler's decisions, without I/O.

KunServe §4.2 ("network requests coordination"): activations, KV and weights share one link;
a bulk transfer must not block an activation (head-of-line blocking), so bulk transfers go
out in chunks and the sender picks the next chunk by priority at every chunk boundary.

* Priority classes: ACTIVATION > KV > WEIGHTS (strict).
* Activations have a lane of their own (`express_activations`): the link opens a second UCX
  endpoint for them, with its own in-flight slots, so an activation is posted at once —
  never behind bulk chunks in this scheduler, nor behind their messages on one UCX endpoint
  (UCX sends an endpoint's messages in order: over TCP one socket, over RDMA one QP) — and
  travels as one message into receives posted ahead (express.py). Without the lane (or in
  `fifo`), activations take the next free slot of the bulk lane, behind the chunks in flight.
* Strict priority holds beyond the queue: while an activation is outstanding (queued, or
  posted and not yet acknowledged), at most `bulk_in_flight_under_activation` bulk chunks
  are on the wire (0: none is posted until it is answered, at most `max_bulk_hold_s`).
* Latency mode: for `latency_window_s` after an activation was submitted, at most
  `latency_in_flight` bulk chunks are on the wire. Measured on a CPU host (docs/
  benchmarks.md, transfer): an activation on its own endpoint still finishes only about
  when the bulk chunks in flight at its arrival have — they hold both sides' UCX progress
  threads and the cores — so it waits for about the bulk bytes in flight: one chunk here.
  Without activations around, bulk runs `max_in_flight` deep (the fixed cost of one chunk
  overlaps the data of the other). On RDMA the NIC moves the bytes and the lanes interleave.
* Within a class: round-robin between transfers, one chunk each (fairness).
* Chunk size = measured bandwidth x target preemption delay / chunks in flight, so the
  bytes already on the wire ahead of a new activation take about `target_delay_s` — but no
  shorter than the measured fixed cost per chunk allows at `min_efficiency` (on a CPU host
  over loopback TCP each UCX message costs ~0.5 ms: a 2 ms target there would halve the
  throughput; on RDMA the cost is microseconds and the target decides). The fixed cost is
  fitted only when chunk sizes vary (transfers' tails); `min_chunk` is the floor meanwhile.
  It is
  fixed per transfer when its first chunk goes (announced to the receiver, which then
  pre-posts its receives without waiting for each chunk's header).
  Activations themselves go out whole (up to `max_activation_chunk`): nothing outranks them.
* Backpressure: a class's queued (not yet sent) bytes stay under `queue_bound_bytes`; a
  transfer is always admitted into an empty class queue, so one larger than the bound
  still goes.
* `fifo=True` is the baseline the benchmark compares against: one queue in arrival order,
  every transfer sent whole.

Time is an argument everywhere (`now`, in seconds, any monotonic origin).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class TrafficClass(enum.IntEnum):
    """Lower value = higher priority."""

    ACTIVATION = 0  # pipeline-stage hidden states, remote-attention q/k/v and results
    KV = 1  # KV blocks (exchange, migration, restore)
    WEIGHTS = 2  # layer weights (restore, prewarm from a peer)


ALIGN = 4096  # chunk sizes are multiples of a page (except a transfer's tail)


@dataclass(frozen=True)
class ChunkingConfig:
    target_delay_s: float = 0.002  # what an activation may wait behind bulk bytes already posted
    min_efficiency: float = 0.9  # chunks at least this long: data time / (data time + fixed cost per chunk)
    min_chunk: int = 8 << 20  # ~5-8 ms on CPU loopback (1-1.5 GiB/s), ~0.3 ms on a 25 GB/s link
    max_chunk: int = 64 << 20
    max_activation_chunk: int = 64 << 20  # activations go out whole up to this size
    max_in_flight: int = 2  # bulk chunks posted and not yet completed (overlaps the fixed cost of the next)
    express_activations: bool = True  # activations on an endpoint of their own (see the module doc)
    max_express_in_flight: int = 4  # activations posted and not yet completed, on that lane
    bulk_in_flight_under_activation: int = 0  # bulk chunks on the wire while an activation is outstanding
    latency_in_flight: int = 1  # bulk chunks on the wire within latency_window_s of an activation
    latency_window_s: float = 0.1
    max_bulk_hold_s: float = 0.05  # ... but bulk is held back at most this long per activation (no starvation)
    initial_bandwidth: float = 1e9  # bytes/s assumed until the first measurement
    ewma_alpha: float = 0.25
    peak_decay: float = 0.97  # per 4 ms window of busy time
    queue_bound_bytes: int = 1 << 30  # per class: queued, not yet sent
    fifo: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.min_chunk <= self.max_chunk:
            raise ValueError(f"need 0 < min_chunk <= max_chunk (got {self.min_chunk}, {self.max_chunk})")
        if self.max_in_flight < 1 or self.max_express_in_flight < 1 or self.target_delay_s <= 0 \
                or self.initial_bandwidth <= 0:
            raise ValueError("max_in_flight >= 1, max_express_in_flight >= 1, target_delay_s > 0 and "
                             "initial_bandwidth > 0 are required")
        if not 0 < self.ewma_alpha <= 1 or self.queue_bound_bytes <= 0:
            raise ValueError("need 0 < ewma_alpha <= 1 and queue_bound_bytes > 0")
        if self.bulk_in_flight_under_activation < 0 or self.max_bulk_hold_s < 0 or self.latency_in_flight < 1 \
                or self.latency_window_s < 0:
            raise ValueError("need bulk_in_flight_under_activation >= 0, max_bulk_hold_s >= 0, latency_in_flight >= 1"
                             " and latency_window_s >= 0")
        if not 0 <= self.min_efficiency < 1:
            raise ValueError("need 0 <= min_efficiency < 1")


class BandwidthEstimator:
    """The link's rate B and its fixed cost per chunk o.

    B is a slowly decaying *peak* of the rate over windows of at least `window_s` of busy
    time (chunks in flight): bursts of completions are averaged, and the peak is kept because
    what a window achieves includes the fixed costs — sizing chunks from the mean would
    shrink them, which lowers the rate, which shrinks them further.

    o is the intercept of a least-squares line through recent (chunk bytes, service time)
    samples: time = bytes / B + o (UCX rendezvous round trips, completions crossing threads).
    Sizes vary naturally (activations, the last chunk of each transfer, chunk sizes that
    follow B); while they do not vary enough, o keeps its last value."""

    def __init__(self, initial: float, alpha: float = 0.25, window_s: float = 0.004, decay: float = 0.97,
                 history: int = 64) -> None:
        self.value = initial  # B, bytes/s
        self.overhead = 0.0  # o, seconds per chunk
        self.alpha, self.window_s, self.decay = alpha, window_s, decay
        self.samples = 0
        self._bytes = 0
        self._busy = 0.0
        self._points: deque[tuple[int, float]] = deque(maxlen=history)
        self._fits = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """One chunk of `nbytes` completed after `seconds` of busy time."""
        seconds = max(0.0, seconds)
        self._points.append((nbytes, seconds))
        self._fit_overhead()
        self._bytes += nbytes
        self._busy += seconds
        if self._busy < self.window_s or self._bytes < ALIGN:
            return
        rate = self._bytes / self._busy
        self.value = rate if self.samples == 0 else max(rate, self.value * self.decay)
        self.samples += 1
        self._bytes, self._busy = 0, 0.0

    def _fit_overhead(self) -> None:
        pts = self._points
        if len(pts) < 8:
            return
        xs = [p[0] for p in pts]
        if max(xs) < 1.5 * max(1, min(xs)):
            return  # sizes too alike: the intercept is not determined
        n = len(pts)
        mx, my = sum(xs) / n, sum(p[1] for p in pts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        if slope <= 0:
            return
        fit = max(0.0, my - slope * mx)
        self._fits += 1  # smoothed: one noisy fit must not halve the chunk size
        self.overhead = fit if self._fits == 1 else 0.1 * fit + 0.9 * self.overhead


def chunk_bytes(bandwidth: float, cfg: ChunkingConfig, overhead_s: float = 0.0) -> int:
    """Bulk chunk size: what `target_delay_s` of the link carries (shared by the chunks in
    flight), but at least long enough that the fixed cost per chunk keeps the efficiency at
    `min_efficiency`. Page-aligned and clamped."""
    by_delay = bandwidth * cfg.target_delay_s / cfg.max_in_flight
    by_efficiency = bandwidth * overhead_s * cfg.min_efficiency / (1 - cfg.min_efficiency)
    raw = int(max(by_delay, by_efficiency))
    aligned = max(ALIGN, raw - raw % ALIGN)
    return max(cfg.min_chunk, min(cfg.max_chunk, aligned))


@dataclass
class _Pending:
    tid: int
    cls: TrafficClass
    total: int
    submitted_at: float
    seq_at_submit: int  # link chunk counter when submitted
    offset: int = 0
    next_index: int = 0
    chunk: int = 0  # fixed at the first chunk (the receiver pre-posts receives from it)


@dataclass(frozen=True)
class ChunkPlan:
    tid: int
    cls: TrafficClass
    index: int
    offset: int
    length: int
    last: bool
    chunk_size: int  # this transfer's chunk size: every chunk but the last has exactly this length
    waited_s: float | None  # set on a transfer's first chunk: submit -> first chunk
    chunks_ahead: int | None  # first chunk only: chunks of other transfers started since submit
    express: bool = False  # goes on the link's activation endpoint (its own in-flight slots)


@dataclass
class LinkSchedule:
    cfg: ChunkingConfig = field(default_factory=ChunkingConfig)

    def __post_init__(self) -> None:
        self.bandwidth = BandwidthEstimator(self.cfg.initial_bandwidth, self.cfg.ewma_alpha, decay=self.cfg.peak_decay)
        self._queues: dict[TrafficClass, deque[int]] = {c: deque() for c in TrafficClass}
        self._fifo: deque[int] = deque()
        self._pending: dict[int, _Pending] = {}
        self._queued_bytes: dict[TrafficClass, int] = dict.fromkeys(TrafficClass, 0)
        self.express = self.cfg.express_activations and not self.cfg.fifo
        self.in_flight = 0  # bulk lane
        self.express_in_flight = 0
        self._outstanding: dict[int, float] = {}  # express transfers started, not yet ended -> first post time
        self._last_activation: float | None = None  # when the last activation was submitted
        self.chunks_started = 0
        self._busy_mark: float | None = None  # start of the busy time not yet accounted

    # --- admission -------------------------------------------------------------------
    def can_admit(self, cls: TrafficClass, nbytes: int) -> bool:
        queued = self._queued_bytes[cls]
        return queued == 0 or queued + nbytes <= self.cfg.queue_bound_bytes

    def add(self, tid: int, cls: TrafficClass, nbytes: int, now: float) -> None:
        if tid in self._pending:
            raise ValueError(f"transfer {tid} is already queued")
        if nbytes < 0:
            raise ValueError("a transfer cannot have a negative size")
        self._pending[tid] = _Pending(tid, cls, nbytes, now, self.chunks_started)
        if cls is TrafficClass.ACTIVATION:
            self._last_activation = now
        (self._fifo if self.cfg.fifo else self._queues[cls]).append(tid)
        self._queued_bytes[cls] += nbytes

    def cancel(self, tid: int) -> bool:
        """Drop a transfer's unsent chunks; False if it had none left (or was unknown)."""
        self._outstanding.pop(tid, None)
        p = self._pending.pop(tid, None)
        if p is None:
            return False
        queue = self._fifo if self.cfg.fifo else self._queues[p.cls]
        queue.remove(tid)
        self._queued_bytes[p.cls] -= p.total - p.offset
        return True

    # --- the decision ----------------------------------------------------------------
    def chunk_limit(self, cls: TrafficClass) -> int:
        if self.cfg.fifo:
            return 1 << 62
        if cls is TrafficClass.ACTIVATION:
            return self.cfg.max_activation_chunk
        return chunk_bytes(self.bandwidth.value, self.cfg, self.bandwidth.overhead)

    def next_chunk(self, now: float) -> ChunkPlan | None:
        """The next chunk to post, or None (nothing queued, or the lane's in-flight slots are full).

        An activation on the express lane goes first whenever that lane has a free slot,
        whatever the bulk lane is doing."""
        if self.express and self._queues[TrafficClass.ACTIVATION] \
                and self.express_in_flight < self.cfg.max_express_in_flight:
            return self._plan(self._queues[TrafficClass.ACTIVATION], now, express=True)
        if self.in_flight >= self.bulk_limit(now):
            return None
        if self.cfg.fifo:
            queue = self._fifo
        else:
            bulk = [q for c, q in self._queues.items() if not (self.express and c is TrafficClass.ACTIVATION)]
            queue = next((q for q in bulk if q), None)
        return self._plan(queue, now, express=False) if queue else None

    def _plan(self, queue: deque[int], now: float, *, express: bool) -> ChunkPlan:
        p = self._pending[queue[0]]
        first = p.next_index == 0
        if first:  # one size per transfer, from the bandwidth known when it starts
            p.chunk = max(1, min(p.total, self.chunk_limit(p.cls)))
        length = min(p.total - p.offset, p.chunk)
        plan = ChunkPlan(
            tid=p.tid, cls=p.cls, index=p.next_index, offset=p.offset, length=length,
            last=p.offset + length == p.total, chunk_size=p.chunk,
            waited_s=max(0.0, now - p.submitted_at) if first else None,
            chunks_ahead=self.chunks_started - p.seq_at_submit if first else None,
            express=express,
        )
        p.offset += length
        p.next_index += 1
        self._queued_bytes[p.cls] -= length
        self.chunks_started += 1
        if express:
            self.express_in_flight += 1
            self._outstanding.setdefault(p.tid, now)
        else:
            if self.in_flight == 0:
                self._busy_mark = now  # the bulk lane was idle: busy time starts now
            self.in_flight += 1
        queue.popleft()
        if not plan.last:
            queue.append(p.tid)  # round-robin: back of its class's queue
        else:
            del self._pending[p.tid]
        return plan

    def bulk_limit(self, now: float) -> int:
        """Bulk chunks allowed on the wire now: fewer while an activation is outstanding."""
        if not self.express:
            return self.cfg.max_in_flight
        cfg = self.cfg
        queued = bool(self._queues[TrafficClass.ACTIVATION])
        if queued or any(now - t < cfg.max_bulk_hold_s for t in self._outstanding.values()):
            return min(cfg.max_in_flight, cfg.bulk_in_flight_under_activation)
        if self._last_activation is not None and now - self._last_activation < cfg.latency_window_s:
            return min(cfg.max_in_flight, cfg.latency_in_flight)
        return cfg.max_in_flight

    def hold_expires_at(self) -> float | None:
        """When a bulk hold ends by itself (the caller looks again then), or None."""
        if not self._outstanding or self.cfg.bulk_in_flight_under_activation >= self.cfg.max_in_flight:
            return None
        return min(self._outstanding.values()) + self.cfg.max_bulk_hold_s

    def transfer_ended(self, tid: int) -> None:
        """A transfer was answered (Ack, Nack), cancelled or lost: it holds back no bulk chunk any more."""
        self._outstanding.pop(tid, None)

    def chunk_done(self, length: int, now: float, *, express: bool = False) -> None:
        """A posted chunk completed: free its slot. On the bulk lane the busy time since the
        last event is its service time (chunks in flight queue behind each other on the wire)."""
        if express:  # its time overlaps the bulk lane's and includes its share of the CPUs: no sample
            self.express_in_flight = max(0, self.express_in_flight - 1)
            return
        self.in_flight = max(0, self.in_flight - 1)
        if self._busy_mark is not None:
            self.bandwidth.observe(length, now - self._busy_mark)
        self._busy_mark = now if self.in_flight else None

    def chunk_failed(self, *, express: bool = False) -> None:
        if express:
            self.express_in_flight = max(0, self.express_in_flight - 1)
            return
        self.in_flight = max(0, self.in_flight - 1)
        if not self.in_flight:
            self._busy_mark = None

    # --- introspection (metrics, tests) ----------------------------------------------
    def queued_bytes(self, cls: TrafficClass) -> int:
        return self._queued_bytes[cls]

    def depth(self, cls: TrafficClass) -> int:
        return sum(1 for p in self._pending.values() if p.cls is cls)

    def has_work(self) -> bool:
        return bool(self._pending)

    def is_queued(self, tid: int) -> bool:
        return tid in self._pending
