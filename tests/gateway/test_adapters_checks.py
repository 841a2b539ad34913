"""Runtime LoRA routes without a cluster: the switch, authentication, routing to instances
that registered an adapter, and the gateway's PEFT-directory checks."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.dispatcher.instance_table import InstanceTable
from services.gateway.app import build_app
from services.gateway.catalog import ModelCatalog
from services.gateway.peft_dir import PeftDirError, read_peft_dir
from services.gateway.state import GatewayState
from shared.config import parse_config
from shared.events import InstanceStats, LayerRange, PoolBreakdown, WorkerState, WorkerStats
from shared.policy.admission import serving
from shared.policy.routing import RequestView


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


async def _in_process(config_toml: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
                      ) -> httpx.Response:
    state = GatewayState(parse_config(config_toml), ModelCatalog(), is_draining=lambda: False)
    transport = httpx.ASGITransport(app=build_app(state))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        return await http.post(path, json=body, headers=headers)


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
async def test_runtime_updates_are_off_unless_the_config_turns_them_on(path: str) -> None:
    body = {"lora_name": "a", "lora_path": "/tmp"}
    error = error_of(await _in_process("", path, body), 404)
    assert error["code"] == "not_found" and "allow_runtime_lora_updating" in error["message"]
    on = await _in_process("[gateway]\nallow_runtime_lora_updating = true\n", path, body)
    assert error_of(on, 503)["code"] == "no_capacity"  # on: past the switch (no bus in this test)
    keyed = "[gateway]\nallow_runtime_lora_updating = true\napi_keys = [\"sk-adapters-key\"]\n"
    assert error_of(await _in_process(keyed, path, body), 401)["code"] == "invalid_api_key"


def test_adapter_requests_are_routed_only_to_instances_that_registered_the_adapter() -> None:
    table = InstanceTable(dead_after=3.0, block_size=16, max_batch=8)

    def stats(worker: str, adapters: list[str], used: int) -> WorkerStats:
        inst = InstanceStats(instance_id=f"{worker}-m", model="m", layers=LayerRange(start=0, end=2),
                             kv_blocks_total=64, kv_blocks_used=used, adapters=adapters)
        return WorkerStats(worker_id=worker, seq=0, ts=0.0, device="cpu", state=WorkerState.READY,
                           pool=PoolBreakdown(capacity_bytes=1 << 20), instances=[inst])

    table.stats(stats("w0", ["lora-a"], used=40), 0.0)
    table.stats(stats("w1", [], used=0), 0.0)  # idle, but without the adapter
    views = table.views("m", 0.1)

    def request(adapter: str | None) -> RequestView:
        return RequestView(request_id="r", model="m", prompt_tokens=8, max_tokens=8, adapter=adapter)

    assert [v.instance_id for v in serving(request("lora-a"), views)] == ["w0-m"]
    assert serving(request("lora-b"), views) == []  # nobody has it: the dispatcher refuses (no_capacity)
    assert {v.instance_id for v in serving(request(None), views)} == {"w0-m", "w1-m"}


def test_peft_directory_checks(adapter_dir: Path, tmp_path: Path) -> None:
    info = read_peft_dir(str(adapter_dir), max_rank=8)
    assert (info.rank, info.targets, info.path) == (8, ["o_proj", "q_proj", "v_proj"], adapter_dir.resolve())
    assert info.nbytes == (adapter_dir / "adapter_model.safetensors").stat().st_size and info.base_hint
    with pytest.raises(PeftDirError, match="max_lora_rank"):
        read_peft_dir(str(adapter_dir), max_rank=4)
    for unreadable in ("0" * 4000, "/tmp/a\x00b", str(tmp_path / "missing")):  # never an exception but ours
        with pytest.raises(PeftDirError, match="No LoRA adapter found"):
            read_peft_dir(unreadable, max_rank=8)
    odd = tmp_path / "odd"
    shutil.copytree(adapter_dir, odd)
    for modules, expect in (("all-linear", 7), (["model.layers.0.self_attn.q_proj", "k_proj"], 2)):
        (odd / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": modules}))
        assert len(read_peft_dir(str(odd), max_rank=8).targets) == expect
    for modules in (["lm_head"], ".*proj", [], None):
        (odd / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": modules}))
        with pytest.raises(PeftDirError, match="target_modules|not supported"):
            read_peft_dir(str(odd), max_rank=8)
    (odd / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"], "peft_type": "IA3"}))
    with pytest.raises(PeftDirError, match="not LORA"):
        read_peft_dir(str(odd), max_rank=8)
    (odd / "adapter_config.json").write_text("{not json")
    with pytest.raises(PeftDirError, match="not readable JSON"):
        read_peft_dir(str(odd), max_rank=8)
    (odd / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    (odd / "adapter_model.safetensors").rename(odd / "adapter_model.bin")
    with pytest.raises(PeftDirError, match="adapter_model.bin is not supported"):
        read_peft_dir(str(odd), max_rank=8)
