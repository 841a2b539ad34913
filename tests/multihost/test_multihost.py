"""Tidal across three hosts (network namespaces on one machine, 10.77.0.1-3; issue 37 items 3-4), started
as docs/operations.md "Several hosts" says, every process with its own NATS user: serving through the
gateway on h1 from workers on h2 and h3, an operator's KV migration from one host to the other (over the
data plane, to the address `TIDAL_DATAPLANE_HOST` names), and h3's link cut for 3 s, then 12 s, mid-stream: every
stream is exact or ends with an error event — never a 200 with altered text — and the cluster serves on.

Skipped, saying why, where network namespaces cannot be made (not root, no iproute2)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from e2e.assets import LLAMA, Oracle, TinyAssets, make_assets
from e2e.observer import Observer
from multihost.cluster import WORKERS, MultiHostCluster
from multihost.netns import Hosts, unavailable
from shared.bus import Bus, BusSettings
from shared.events import SamplingParams, SubmitAccepted, SubmitReply, SubmitRequest
from shared.events.ctl import CtlDone, CtlReply, MigrateOut
from shared.subjects import dispatch_submit, worker_ctl

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
WHY_NOT = unavailable()
if WHY_NOT:
    pytest.skip(f"multi-host test needs network namespaces: {WHY_NOT}", allow_module_level=True)

LONG = 400  # tokens per stream: long enough to cut a host's link in the middle
# the migrated request's tokens (no EOS; its 40-token prompt + these fit the 1024 context): with LONG, on a busy
# box (make test beside a CPU hog) it ended during its first move, whose UCX connect across hosts is the slow part
MOVE_TOKENS = 960
CUTS_S = (3.0, 12.0)  # the link of h3 is down this long (issue 37: 3-15 s)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return make_assets(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="module")
def oracle(assets: TinyAssets) -> Oracle:
    return Oracle(assets)


@pytest.fixture(scope="module")
def cluster(assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHostCluster]:
    hosts = Hosts().create()
    running = MultiHostCluster(tmp_path_factory.mktemp("multihost"), hosts, assets)
    try:
        running.start()
        yield running
    finally:
        running.stop()
        hosts.destroy()
        for name, text in running.service_logs().items():  # per-role users: nobody stepped outside its own
            assert "permissions violation" not in text.lower(), (name, text[-3000:])


async def observe(cluster: MultiHostCluster) -> Observer:
    observer = await Observer().start(cluster.role_url("operator"))
    await observer.wait_for(lambda: {s.worker_id for _at, s in observer.stats} >= set(WORKERS.values()), timeout=30)
    return observer


async def test_kv_migration_from_one_host_to_another(cluster: MultiHostCluster, oracle: Oracle) -> None:
    observer = await observe(cluster)
    scheduler = await Bus.connect(BusSettings(url=cluster.role_url("scheduler")), service="scheduler")
    submitter = await Bus.connect(BusSettings(url=cluster.role_url("gateway")), service="gateway")
    try:
        rng = random.Random(5)
        greedy = SamplingParams(temperature=0.0, max_tokens=MOVE_TOKENS, ignore_eos=True)
        ids = [rng.randrange(16, 256) for _ in range(40)]
        reply = await submitter.request(dispatch_submit(), SubmitRequest(
            request_id="mh-move", model=LLAMA, prompt_token_ids=ids, sampling=greedy, arrival_ts=time.time()),
            SubmitReply)
        assert isinstance(reply, SubmitAccepted), reply
        await observer.wait_for(lambda: len(observer.chunks("mh-move")) >= 2, timeout=60)
        (source,) = observer.workers("mh-move")
        destination = next(w for w in WORKERS.values() if w != source)
        stats = [s for _at, s in observer.stats if s.worker_id == destination][-1]
        (instance,) = [i.instance_id for i in stats.instances if i.model == LLAMA]
        moved = await scheduler.request(worker_ctl(source), MigrateOut(
            idempotency_key="mh-move-1", request_id="mh-move", destination=destination,
            destination_instance=instance, mode="kv"), CtlReply, timeout=60)
        assert isinstance(moved, CtlDone) and moved.migration is not None, moved
        assert moved.migration.mode == "kv" and moved.migration.kv_bytes > 0, moved.migration  # over UCX, no fallback
        print(f"KV migration {source} -> {destination}: {moved.migration.kv_bytes} bytes in "
              f"{moved.migration.stages} stages, downtime {moved.migration.downtime_s * 1000:.0f} ms")
        await observer.wait_for(lambda: any(c.final for c in observer.chunks("mh-move")), timeout=120)
        chunks = sorted(observer.chunks("mh-move"), key=lambda c: c.seq)
        assert [c.seq for c in chunks] == list(range(len(chunks))), "a gap or a duplicate"
        assert observer.workers("mh-move") == [source, destination]
        from services.gpu_worker.engine.sampling_params import SamplingParams as EngineSampling

        (want,) = oracle._engine(LLAMA).generate([ids], EngineSampling(temperature=0.0, max_tokens=MOVE_TOKENS,
                                                                        ignore_eos=True))
        assert tuple(t for c in chunks for t in c.token_ids) == tuple(want.token_ids)
    finally:
        await scheduler.close()
        await submitter.close()
        await observer.stop()


@dataclass
class Outcome:
    status: int
    text: str = ""
    finish: str | None = None
    error: str | None = None  # the error event's message
    done: bool = False  # `data: [DONE]` seen
    id: str = ""  # the completion's id
    hung: bool = False  # no byte for STALL_S: the stream neither went on nor ended


STALL_S = 90.0  # far beyond any pause of a healthy stream (the cut is 5 s, re-dispatch a few more)


async def stream(client: httpx.AsyncClient, prompt: str) -> Outcome:
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        outcome = Outcome(response.status_code)
        if response.status_code != 200:
            outcome.error = (await response.aread()).decode(errors="replace")
            return outcome
        lines = response.aiter_lines()
        while True:
            try:
                line = await asyncio.wait_for(anext(lines), STALL_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                outcome.hung = True
                break
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                continue
            event = json.loads(line[len("data: "):])
            outcome.id = event.get("id", outcome.id)
            if "error" in event:
                outcome.error = str(event["error"])
            for choice in event.get("choices", []):
                outcome.text += choice.get("text") or ""
                outcome.finish = choice.get("finish_reason") or outcome.finish
        return outcome


def check_outcomes(outcomes: list[Outcome], prompts: list[str], wants: dict, observer: Observer, caught) -> None:
    hung = [(o.id, len(o.text), {r: (observer.workers(r), len(observer.chunks(r))) for r in observer.streams
                                  if o.id and r.startswith(o.id)}) for o in outcomes if o.hung]
    assert not hung, f"streams that never ended (cut h3 while it ran {caught}): {hung}"
    for i, outcome in enumerate(outcomes):
        want = wants[prompts[i % 4]]
        assert outcome.status == 200, outcome
        if outcome.error is None:  # a clean end must be the exact text
            assert (outcome.text, outcome.finish, outcome.done) == (want.text, want.finish_reason, True), \
                (i, outcome, want.text)
        else:  # a stream that could not be finished says so
            assert outcome.done, outcome


ROUNDS = 4  # a round whose streams all went to h2 (h3 still settling after the previous cut) is checked, then retried


@pytest.mark.parametrize("cut_s", CUTS_S)
async def test_a_worker_hosts_link_cut_mid_stream_corrupts_no_stream(cluster: MultiHostCluster, oracle: Oracle,
                                                                     cut_s: float) -> None:
    prompts = await asyncio.to_thread(oracle.long_prompts, LLAMA, 4, LONG)
    wants = {p: oracle.greedy(LLAMA, prompt=p, max_tokens=LONG) for p in prompts}
    observer = await observe(cluster)
    caught: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=300) as client:
            for _round in range(ROUNDS):
                tasks = [asyncio.ensure_future(stream(client, prompts[i % 4])) for i in range(8)]

                def on_h3_mid_stream() -> list[str]:
                    return [r for r in observer.active() if "w3" in observer.workers(r) and len(observer.chunks(r)) >= 2]

                try:
                    caught = await observer.wait_for(on_h3_mid_stream, timeout=60)
                except AssertionError:  # none placed on h3 this round: every stream must still be exact
                    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
                    check_outcomes(outcomes, prompts, wants, observer, caught)
                    continue
                cluster.hosts.cut(3)
                await asyncio.sleep(cut_s)
                cluster.hosts.heal(3)
                outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
                break
            after = await stream(client, prompts[0])  # the cluster serves on
    finally:
        await observer.stop()
    assert caught, f"no stream was running on h3 in {ROUNDS} rounds of 8, so its link was never cut"
    check_outcomes(outcomes, prompts, wants, observer, caught)
    assert after.status == 200 and after.error is None and after.text == wants[prompts[0]].text, after
    errored = sum(o.error is not None for o in outcomes)
    print(f"h3 cut {cut_s:.0f}s with {len(caught)} of its streams mid-way: {len(outcomes) - errored} of "
          f"{len(outcomes)} streams exact, {errored} ended with an error event; served exactly after")
