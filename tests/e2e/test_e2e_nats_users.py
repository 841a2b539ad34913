"""The whole cluster on a nats-server with per-role users, as `tidal up` runs its embedded one (issue 22
item 7): every service connects as its own user and works within the permissions the subject catalog
gives it (completions, a runtime LoRA load from the gateway to the workers, the planner and the
predictor); a client without credentials cannot connect at all, so nobody can forge a request to the
planner."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.assets import LLAMA, LORA, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster
from shared.bus import Bus, BusSettings
from shared.events.plan import CapacityRequest
from shared.subjects import planner_capacity
from shared.wire import Unavailable

pytestmark = pytest.mark.timeout(240)
SWITCH = "TIDAL__GATEWAY__ALLOW_RUNTIME_LORA_UPDATING"
SPEC = ClusterSpec(workers={"w0": [LLAMA], "w1": [LLAMA]}, control_plane=True, nats_users=True)


@pytest.fixture(scope="module")
def cluster(tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "true"  # the processes read it at start
    try:
        running = E2ECluster(tmp_path_factory.mktemp("cluster"), SPEC, tiny_assets).start()
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before
    try:
        yield running
    finally:
        running.stop()


async def test_every_service_works_as_its_own_user_and_strangers_are_shut_out(cluster: E2ECluster,
                                                                             tiny_assets: TinyAssets) -> None:
    client = cluster.openai()
    plain = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=4, temperature=0)
    assert plain.choices[0].text and plain.usage.completion_tokens == 4
    _base, adapter_dir = tiny_assets.adapters[LORA]
    loaded = httpx.post(cluster.base_url + "/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "users-lora", "lora_path": str(adapter_dir)})  # gateway -> worker.ctl
    assert loaded.status_code == 200 and loaded.json()["failed"] == [], loaded.text
    with_adapter = client.completions.create(model="users-lora", prompt="The tide", max_tokens=4, temperature=0)
    assert with_adapter.usage.completion_tokens == 4
    unloaded = httpx.post(cluster.base_url + "/v1/unload_lora_adapter", json={"lora_name": "users-lora"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text

    assert cluster.nats is not None
    with pytest.raises(Unavailable):  # no credentials: no connection, so no forged CapacityRequest
        stranger = await Bus.connect(BusSettings(url=cluster.nats.url, initial_connect_s=2.0), service="stranger")
        await stranger.publish(planner_capacity(), CapacityRequest(dispatcher_id="forged", model=LLAMA,
                                                                   queued_requests=1, ts=time.time()))
    time.sleep(1.0)  # a heartbeat or stats interval of every service after the requests above
    for name, proc in cluster.procs.items():
        assert "permissions violation" not in proc.log().lower(), (name, proc.log()[-3000:])
