"""A buddy-group member admits nothing while it collapses (issue 27 item 1): from the moment a
peer's loss is decided until its engine thread has run the collapse, an assignment is refused
`no_capacity` naming the group (the dispatcher places it elsewhere), never admitted into a pipeline
that is going away; once the collapse has run (the instance in no group) it admits again."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.gpu_worker.admission import refusal
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.group.loopback import Loopback
from services.gpu_worker.group.member import GroupMember, Stage
from services.gpu_worker.instance import ModelInstance
from shared.events import Assignment, SamplingParams


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> ModelInstance:
    model = make_model(Path(tmp_path_factory.mktemp("adm")) / "m", arch="qwen2", layers=2, hidden=64, heads=4,
                       kv_heads=2, seed=5)
    engine = LLMEngine(EngineConfig(str(model), pool_bytes=32 << 20, block_size=8, max_num_seqs=4,
                                    max_num_batched_tokens=64, device="cpu"))
    return ModelInstance("w0-tiny", "tiny", engine, "w0")


def assignment(rid: str) -> Assignment:
    return Assignment(idempotency_key=f"{rid}:0", request_id=rid, instance_id="w0-tiny", model="tiny",
                      prompt_token_ids=[1, 2, 3], arrival_ts=time.time(),
                      sampling=SamplingParams(temperature=0.0, max_tokens=4))


def test_a_collapsing_member_refuses_assignments_until_the_collapse_ran(instance: ModelInstance) -> None:
    def why(rid: str) -> tuple[str, str] | None:
        return refusal(assignment(rid), worker_id="w0", draining=False, instances={"w0-tiny": instance}, active={},
                       max_waiting=8)

    member = GroupMember(instance.engine, "w0-tiny", Loopback().port("w0-tiny"))
    member.join("g", [Stage("w0-tiny", range(0, 1)), Stage("w1-tiny", range(1, 2))], drop=False)
    instance.group = member
    assert why("r0") is None  # a member admits (it owns what it admits)
    member.collapsing = True  # a peer's loss decided (member_loss.py), the engine thread not there yet
    refused = why("r1")
    assert refused is not None and refused[0] == "no_capacity" and "collapsing" in refused[1] and "g" in refused[1]
    instance.group = None  # the collapse ran: the instance runs alone
    assert why("r2") is None
