"""One arm of `tidal bench prefix`: a cluster of real processes on the default config (the arm's switches
set), a prefix trace sent open loop through the official `openai` client, and the bus watched for the
workers' PrefixSummary counters and which worker served each request.

The cluster is `shared/default_cluster.toml` as `tidal up` runs it — its two CPU workers, SmolLM2 and
the demo models, the planner — with `[dispatcher] prefix_routing` and `[policies] prefix_caching` set
per arm, the planner's request migrations off unless asked (`arm_config`), its own NATS and gateway
port, models cached in `--data-dir` (built once, shared by the arms).
"""
from __future__ import annotations

import asyncio
import re
import socket
import time
from pathlib import Path

from loadgen.repro.live_services import LiveServices
from loadgen.runner.payloads import DEFAULT_ID_RANGE
from loadgen.traces.prefix import prompt_ids
from loadgen.traces.schema import TraceRecord
from tidal.bench.prefix_stats import ArmResult, Outcome

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "default_cluster.toml"
CACHE_SWITCH = ("policies", "prefix_caching")  # the engine's automatic prefix caching (default on)
ROUTING_SWITCH = ("dispatcher", "prefix_routing")
SWITCHES = {"off": (False, False), "on": (True, False), "routed": (True, True)}  # arm -> (caching, routing)


def set_key(toml: str, section: str, key: str, value: str) -> str:
    """`toml` with `key = value` in `[section]`: the line replaced if there, else added under the header."""
    header = re.compile(rf"^\[{re.escape(section)}\]\s*$", re.M)
    found = header.search(toml)
    if found is None:
        return f"{toml.rstrip()}\n\n[{section}]\n{key} = {value}\n"
    end = re.compile(r"^\[", re.M).search(toml, found.end())
    stop = end.start() if end else len(toml)
    body = toml[found.end():stop]
    line = re.compile(rf"^{re.escape(key)}\s*=.*$", re.M)
    body = line.sub(f"{key} = {value}", body, count=1) if line.search(body) else f"\n{key} = {value}{body}"
    return toml[:found.end()] + body + toml[stop:]


def arm_config(arm: str, *, data_dir: Path, port: int, base: str, migration: bool = False) -> str:
    """The base config with the arm's switches, its own port and data dir; unless `migration`, the planner's
    request migrations off (`[policies] migration = "off"`: MELL's consolidation moves running requests
    onto the fewest workers, each move a re-prefill elsewhere, which is not what this bench measures)."""
    caching, routing = SWITCHES[arm]
    text = set_key(base, "cluster", "data_dir", f'"{data_dir}"')
    if not migration:
        text = set_key(text, "policies", "migration", '"off"')
    text = set_key(text, "gateway", "port", str(port))
    text = set_key(text, *ROUTING_SWITCH, "true" if routing else "false")
    return set_key(text, *CACHE_SWITCH, "true" if caching else "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cluster(arm: str, root: Path, data_dir: Path, base: str, model: str, *,
                  migration: bool = False) -> tuple[LiveServices, str]:
    """The arm's cluster, serving (one completion through the gateway); stopped again if starting fails."""
    from shared.config import parse_config

    port = free_port()
    text = arm_config(arm, data_dir=data_dir, port=port, base=base, migration=migration)
    cfg = parse_config(text)  # refuses a switch this tree does not know
    root.mkdir(parents=True, exist_ok=True)
    (root / "cluster.toml").write_text(text)
    services = LiveServices(root, root / "cluster.toml", f"prefix-{arm}")
    url = f"http://127.0.0.1:{port}"
    try:
        services.start_nats()
        services.launch("registry")
        for w in cfg.workers:
            services.launch(f"gpu_worker:{w.id}", "--worker-id", w.id)
        for name in ("dispatcher", "planner", "predictor", "gateway"):
            services.launch(name)
        services.warm_up(url, [model], time.monotonic() + 600.0, timeout_s=60.0)
    except BaseException:
        services.stop()
        raise
    return services, url


async def run_arm(arm: str, services: LiveServices, url: str, records: list[tuple[str, TraceRecord]], *,
                  seed: int, model: str, timeout_s: float) -> ArmResult:
    """Send every record at its arrival time; wait for all; the workers' counters and routes on the side."""
    from openai import AsyncOpenAI

    from shared.bus import Bus, BusSettings, Delivery
    from shared.events import PrefixSummary
    from shared.events.stream import StreamMessage, TokenChunk
    from shared.subjects import CATALOG, worker_prefixes

    result = ArmResult(arm)
    latest: dict[tuple[str, str], PrefixSummary] = {}
    served: dict[str, str] = {}  # request id -> worker of its first chunk
    bus = await Bus.connect(BusSettings(url=services.nats_url), service="cli")

    async def on_summary(msg: PrefixSummary, _ctx: Delivery) -> None:
        if msg.model == model:
            latest[(msg.worker_id, msg.instance_id)] = msg

    async def on_chunk(msg: StreamMessage, _ctx: Delivery) -> None:
        if isinstance(msg, TokenChunk) and msg.seq == 0 and msg.worker_id:
            served.setdefault(msg.request_id, msg.worker_id)

    await bus.subscribe(worker_prefixes(), PrefixSummary, on_summary)
    out = CATALOG["request.out"].wildcard
    await bus.subscribe(out, StreamMessage, on_chunk, label=out)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout_s, max_retries=0)
    start = time.monotonic()

    async def one(index: int, shape: str, rec: TraceRecord) -> Outcome:
        await asyncio.sleep(max(0.0, rec.arrival_s - (time.monotonic() - start)))
        ids = prompt_ids(seed, rec.segments, DEFAULT_ID_RANGE)
        sent = time.monotonic()
        first: float | None = None
        text, tokens = [], 0
        try:
            stream = await client.completions.create(
                model=model, prompt=ids, max_tokens=rec.output_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.monotonic()
                    text.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # counted as failed; the run goes on
            return Outcome(index, shape, sent - start, None, None, 0, "", error=repr(exc)[:200])
        done = time.monotonic()
        return Outcome(index, shape, sent - start, None if first is None else first - sent, done - sent, tokens,
                       "".join(text))

    try:
        result.outcomes = list(await asyncio.gather(*(one(i, shape, rec) for i, (shape, rec) in enumerate(records))))
        await asyncio.sleep(1.0)  # the last summaries (sent within 0.25 s of a change)
    finally:
        await client.close()
        await bus.close()
    for (worker, _iid), msg in latest.items():
        q, h = result.hits.get(worker, (0, 0))
        result.hits[worker] = (q + msg.queried_blocks, h + msg.hit_blocks)
    for worker in served.values():
        result.routes[worker] = result.routes.get(worker, 0) + 1
    return result


__all__ = ["CACHE_SWITCH", "DEFAULT_CONFIG", "ROUTING_SWITCH", "SWITCHES", "arm_config", "run_arm", "set_key",
           "start_cluster"]
