"""A keeper frees an owner's KV whatever path the owner's requests took (issue 27 item 2).

Two members joined by the loopback channel; the owner restores its layers and migrates back
while one of its requests is aborted after it stopped launching micro-batches (`draining`) and
another is taken out with no output at all (a live migration's detach). Neither ever reaches
the keeper in a stage pass (`StagePass.freed`), yet once the owner runs alone the keeper holds
none of its KV, so LeaveGroup is not refused `busy` forever. The owner's other requests end
token-exact."""
from __future__ import annotations

from collections import deque

from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.group.loopback import Loopback
from services.gpu_worker.group.member import GroupMember, Stage
from test_buddy_group import LAYERS, collect, engine, model_dir, reference  # noqa: F401 - the fixture

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py
NEW = 40


def test_the_keeper_frees_every_request_of_an_owner_that_went_solo(model_dir) -> None:  # noqa: F811
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    prompts = {f"a{i}": [7 + i, 30, 11 + i, 4, 9, 2 + i] * (i + 1) for i in range(4)}
    expected = reference(model_dir, {rid: (p, params) for rid, p in prompts.items()})
    loop = Loopback()
    a = loop.add(GroupMember(engine(model_dir), "a", loop.port("a")))
    b = loop.add(GroupMember(engine(model_dir), "b", loop.port("b")))
    stages = [Stage("a", range(0, 2)), Stage("b", range(2, LAYERS))]
    a.join("g", stages), b.join("g", stages)
    for rid, p in prompts.items():
        a.engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {}

    def round_() -> None:
        for m in (a, b):
            if m is a and a.back.phase == "precopy":  # the KV lands before the micro-batch's logits:
                held, loop._activations["a"] = loop._activations["a"], deque()  # a waits for them (draining)
                collect(tokens, loop.deliver("a", kv_per_round=99))
                collect(tokens, a.step())
                loop._activations["a"].extendleft(reversed(held))
                continue
            collect(tokens, loop.deliver(m.member_id, kv_per_round=99))
            collect(tokens, m.step())

    for _ in range(6):  # every request of a runs through b's stage: b holds their KV of layers 2-3
        round_()
    assert set(b.executor.owner_of.values()) == {"a"} and len(b.executor.owner_of) == 4
    detached = a.engine.scheduler.running[-1].seq_id
    a.engine.detach(detached, keep_kv=False)  # moved away (a live migration): no output, no pass
    assert a.restore_layers(2, LAYERS)
    aborted = None
    for _ in range(400):
        round_()
        if a.back.phase == "draining" and aborted is None:
            aborted = a.engine.scheduler.running[0].seq_id
            a.engine.abort(aborted)  # finished while the owner launches nothing: no pass carries it
        if a.solo and not a.busy and not a.engine.has_unfinished:
            break
    assert aborted is not None, "the owner never stopped to drain (the test did not exercise the path)"
    assert a.solo
    collect(tokens, loop.deliver("b", kv_per_round=99))
    assert b.foreign() == [] and b.executor.owner_of == {}
    assert b.leave_blocker() is None
    for rid in prompts:
        if rid not in (aborted, detached):
            assert tokens[rid] == expected[rid], rid
    assert a.leave_blocker() is None
