"""Scale from zero, live: gateway, dispatcher (`scale_from_zero`), planner, registry and two gpu_worker
processes, one of which starts with no model at all.

A request for a catalog model no instance serves is queued by the dispatcher, the planner scales the
model up (ScaleUp -> LoadModel) and the request completes token-exact against the in-process engine;
a model no worker has room for keeps its requests queued, and past the queue bound the gateway
answers 503 with Retry-After."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from e2e.assets import LLAMA, QWEN, Oracle, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster
from shared.bus import Bus, BusSettings, Delivery
from shared.events.plan import PlanApplied, PlanDecided, PlanEvent, ScaleUp
from shared.subjects import CATALOG

pytestmark = pytest.mark.timeout(300)

# A catalog model far larger than any worker's pool: its config.json only (the tokenizer is copied in
# by the test); no worker can start it, so its requests stay queued.
HUGE = "huge-llama"
HUGE_DIR = Path(tempfile.mkdtemp(prefix="tidal-huge-"))
(HUGE_DIR / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}))

CLUSTER_SPEC = ClusterSpec(
    workers={"w0": [LLAMA], "w1": []}, control_plane=True, scale_from_zero=True, queue_bound=2,
    extra_toml=f'[planner]\ninterval = "300ms"\nlease_ttl = "1s"\n\n'
               f'[[models]]\nname = "{HUGE}"\npath = "{HUGE_DIR}"\nmax_context = 1024\n',
)
PROMPT = "The tide comes in"


async def test_a_request_to_a_model_with_no_instance_is_queued_scaled_up_and_answered(
        cluster: E2ECluster, oracle: Oracle) -> None:
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="test")
    events: list[object] = []

    async def on(msg: object, _ctx: Delivery) -> None:
        events.append(msg)

    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on)
    try:
        want = oracle.greedy(QWEN, prompt=PROMPT, max_tokens=16)
        client = cluster.async_openai(timeout=120.0)
        got = await client.completions.create(model=QWEN, prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text and got.usage is not None
        assert got.usage.completion_tokens == len(want.token_ids)
        scale_ups = [e for e in events if isinstance(e, PlanDecided) and isinstance(e.plan.actions[0], ScaleUp)]
        assert [e.plan.actions[0].model for e in scale_ups] == [QWEN]  # type: ignore[union-attr]
        assert scale_ups[0].plan.trigger == "capacity_request"
        # the worker serves the new instance as soon as it is up, which can be before the planner has read the
        # LoadModel's reply and published PlanApplied (on a busy box, well before): wait for it
        applied = scale_ups[0].plan.plan_id
        deadline = asyncio.get_running_loop().time() + 30.0
        while not any(isinstance(e, PlanApplied) and e.plan_id == applied for e in events):
            assert asyncio.get_running_loop().time() < deadline, f"no PlanApplied for {applied} within 30 s"
            await asyncio.sleep(0.05)
        # the new instance serves the next request at once (no second scale-up)
        again = await client.completions.create(model=QWEN, prompt=PROMPT, max_tokens=16, temperature=0)
        assert again.choices[0].text == want.text
        assert len([e for e in events if isinstance(e, PlanDecided) and isinstance(e.plan.actions[0], ScaleUp)]) == 1
    finally:
        await bus.close()


async def test_past_the_queue_bound_a_cold_model_is_503_with_retry_after(cluster: E2ECluster,
                                                                         tiny_assets: TinyAssets) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = tiny_assets.models[LLAMA] / name
        if source.is_file():
            shutil.copy(source, HUGE_DIR / name)
    body = {"model": HUGE, "prompt": PROMPT, "max_tokens": 4}
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60.0) as http:
        waiting = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
        try:
            async def third() -> httpx.Response:
                while True:
                    resp = await http.post("/v1/completions", json=body)
                    if resp.status_code != 200 and resp.json()["error"]["code"] != "model_not_found":
                        return resp
                    await asyncio.sleep(0.2)  # the catalog may not list the model yet

            await asyncio.sleep(1.0)  # the first two are queued (the planner has no room for the model)
            resp = await asyncio.wait_for(third(), 30)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "no_capacity" and int(resp.headers["retry-after"]) >= 1
            assert all(not t.done() for t in waiting)  # still queued, not refused
        finally:
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
