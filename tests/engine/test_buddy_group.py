"""KunServe group execution in one process: two engines as two buddy-group members joined by
the loopback channel (the real wire format). Tokens must equal an unsplit engine's, greedy
and seeded; micro-batches overlap; each token costs one activation hop per stage; requests
decoding when the group forms (victims) keep decoding through remote attention while their
KV is exchanged, and end token-exact with no KV left behind.

The checks take a `device`: tests/gpu/test_cuda_group.py runs the same ones on CUDA."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.group.loopback import Loopback
from services.gpu_worker.group.member import GroupMember, Stage
from services.gpu_worker.group.wire import StagePass, decode, encode, spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py

LAYERS = 4
NEW = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("group")
    return make_model(root / "m", arch="qwen2", layers=LAYERS, hidden=64, heads=4, kv_heads=2, seed=5)


def engine(model_dir: Path, device: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=8, max_num_seqs=8,
                                  max_num_batched_tokens=256, max_prefill_chunk=24, device=device))


def requests(seeded: bool) -> dict[str, tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for i, n in enumerate([5, 30, 11, 19, 7, 26]):
        params = SamplingParams(temperature=0.9, seed=100 + i, max_tokens=NEW) if seeded else \
            SamplingParams(temperature=0.0, max_tokens=NEW)
        out[f"r{i}"] = (torch.randint(0, 500, (n,), generator=g).tolist(), params)
    return out


def reference(model_dir: Path, reqs, device: str = "cpu") -> dict[str, list[int]]:
    e = engine(model_dir, device)
    for rid, (prompt, params) in reqs.items():
        e.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in reqs}
    while e.has_unfinished:
        for o in e.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens


def collect(tokens: dict[str, list[int]], outputs) -> None:
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)


def pair(model_dir: Path, device: str = "cpu") -> tuple[Loopback, GroupMember, GroupMember]:
    loop = Loopback()
    a = loop.add(GroupMember(engine(model_dir, device), "a", loop.port("a")))
    b = loop.add(GroupMember(engine(model_dir, device), "b", loop.port("b")))
    return loop, a, b


def drive(loop: Loopback, members: list[GroupMember], tokens, *, kv_every: int = 1, rounds: int = 2000) -> int:
    """Round-robin: deliver, launch, exchange. KV frames pass every `kv_every` rounds."""
    most_in_flight = 0
    for r in range(rounds):
        if not any(m.busy for m in members):
            for m in members:
                collect(tokens, loop.deliver(m.member_id, kv_per_round=99))
            return most_in_flight
        for m in members:
            collect(tokens, loop.deliver(m.member_id, kv_per_round=1 if r % kv_every == 0 else 0))
            collect(tokens, m.step())
            most_in_flight = max(most_in_flight, len(m.in_flight))
            m.pump_exchange(1)
    raise AssertionError("the group did not finish")


def check_group_tokens_equal_unsplit_run(model_dir: Path, seeded: bool, split: int,
                                         device: str = "cpu") -> tuple[GroupMember, GroupMember]:
    reqs = requests(seeded)
    expected = reference(model_dir, reqs, device)
    loop, a, b = pair(model_dir, device)
    stages = [Stage("a", range(0, split)), Stage("b", range(split, LAYERS))]
    assert a.join("g1", stages) > 0 and b.join("g1", stages) > 0
    assert a.engine.runner.resident_layers() == list(range(split))
    assert b.engine.runner.resident_layers() == list(range(split, LAYERS))
    items = list(reqs.items())
    tokens: dict[str, list[int]] = {}
    a.engine.add_request(items[0][0], *items[0][1])
    collect(tokens, a.step())  # micro-batch 0 is now in stage 1 (on b)
    assert len(a.in_flight) == 1
    for i, (rid, (prompt, params)) in enumerate(items[1:], start=1):
        (a if i % 2 == 0 else b).engine.add_request(rid, prompt, params)  # both owners: stage 0 and stage 1
    most = drive(loop, [a, b], tokens)
    assert tokens == expected
    assert most == 2, "the owner keeps a second micro-batch going while the first is in the other stage"
    assert loop.sent["AttnCall"] == 0 and loop.sent["KvExchange"] == 0  # no victims: nothing remote
    for m in (a, b):  # every sequence's KV is freed on every member
        assert m.engine.blocks.num_used_blocks == 0
    return a, b


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("split", [1, 3])
def test_group_tokens_equal_unsplit_run(model_dir, seeded, split):
    check_group_tokens_equal_unsplit_run(model_dir, seeded, split)


def check_each_micro_batch_costs_one_hop_per_stage(model_dir: Path, device: str = "cpu") -> None:
    loop, a, b = pair(model_dir, device)
    stages = [Stage("a", range(0, 2)), Stage("b", range(2, LAYERS))]
    a.join("g", stages), b.join("g", stages)
    a.engine.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
    b.engine.add_request("y", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=1))
    tokens: dict[str, list[int]] = {}
    drive(loop, [a, b], tokens)
    assert len(tokens["x"]) == len(tokens["y"]) == 1
    # x: a runs stage 0, one StagePass to b, one StageDone back; y: a StagePass to a and one back to b
    assert loop.sent["StagePass"] == 3 and loop.sent["StageDone"] == 1


def test_each_micro_batch_costs_one_hop_per_stage(model_dir):
    check_each_micro_batch_costs_one_hop_per_stage(model_dir)


def check_requests_decoding_through_a_drop_are_token_exact(model_dir: Path, seeded: bool,
                                                          device: str = "cpu") -> tuple[GroupMember, GroupMember]:
    reqs = requests(seeded)
    expected = reference(model_dir, reqs, device)
    loop, a, b = pair(model_dir, device)
    for i, (rid, (prompt, params)) in enumerate(reqs.items()):
        (a if i % 2 == 0 else b).engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # unsplit: prefill and a few tokens on each member alone
        for m in (a, b):
            collect(tokens, m.engine.step())
    assert all(0 < len(t) < NEW for t in tokens.values())
    stages = [Stage("a", range(0, 2)), Stage("b", range(2, LAYERS))]
    a.join("g", stages), b.join("g", stages)
    assert set(a.victims) == {"r0", "r2", "r4"} and set(b.victims) == {"r1", "r3", "r5"}
    drive(loop, [a, b], tokens, kv_every=4)  # the exchange is slow: victims decode on remote attention meanwhile
    assert tokens == expected
    assert a.holder.served > 0 and b.holder.served > 0, "victims' attention ran where their KV was"
    assert loop.sent["KvExchange"] == 4 and loop.sent["KvLanded"] == 4  # two dropped layers each way
    for m in (a, b):
        assert m.engine.blocks.num_used_blocks == 0 and not m.exchanging
    return a, b


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_requests_decoding_through_a_drop_are_token_exact(model_dir, seeded):
    check_requests_decoding_through_a_drop_are_token_exact(model_dir, seeded)


def test_wire_roundtrip_and_bad_messages():
    hidden = torch.randn(3, 8)
    frame = StagePass(group_id="g", owner="a", micro_id=7, stage=1, chunks=[], freed=["z"], hidden=spec(hidden))
    got, tensors = decode(encode(frame, [hidden]))
    assert got == frame and torch.equal(tensors[0], hidden)
    data = encode(frame, [hidden])
    with pytest.raises(ValueError, match="overruns"):
        decode(data[:-4])
    with pytest.raises(ValueError, match="bytes after its tensors"):
        decode(data + b"\0")
    with pytest.raises(ValueError, match="carries"):
        spec(torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_three_member_group_is_token_exact_with_requests_decoding_through_the_drop(model_dir, seeded):
    """A group of three (stages [0,1) [1,3) [3,4), the middle one dropping two ranges): requests
    already decoding on each member keep decoding on remote attention while KV moves three ways,
    new requests on every owner run the three-stage pipeline, and all end token-exact."""
    reqs = requests(seeded)
    expected = reference(model_dir, reqs)
    loop = Loopback()
    members = [loop.add(GroupMember(engine(model_dir), m, loop.port(m))) for m in ("a", "b", "c")]
    items = list(reqs.items())
    tokens: dict[str, list[int]] = {}
    for i, (rid, (prompt, params)) in enumerate(items[:3]):
        members[i].engine.add_request(rid, prompt, params)
    for _ in range(3):  # unsplit: prefill and a few tokens on each member alone
        for m in members:
            collect(tokens, m.engine.step())
    stages = [Stage("a", range(0, 1)), Stage("b", range(1, 3)), Stage("c", range(3, LAYERS))]
    for m in members:
        assert m.join("g3", stages) > 0
    assert [m.engine.runner.resident_layers() for m in members] == [[0], [1, 2], [3]]
    assert [set(m.victims) for m in members] == [{"r0"}, {"r1"}, {"r2"}]
    for i, (rid, (prompt, params)) in enumerate(items[3:]):
        members[i].engine.add_request(rid, prompt, params)  # owners of every stage
    drive(loop, members, tokens, kv_every=3)
    assert tokens == expected
    assert sum(m.holder.served for m in members) > 0, "victims' attention ran where their KV was"
    assert loop.sent["KvExchange"] == loop.sent["KvLanded"] > 0
    for m in members:
        assert m.engine.blocks.num_used_blocks == 0 and not m.exchanging


def test_victims_on_shared_prefix_blocks_are_token_exact(model_dir):
    """Prefix caching: requests admitted on a cached shared prefix (their first blocks shared with
    each other) decode through the drop on remote attention and the KV exchange; tokens equal a
    cache-off unsplit run. A member holding a layer subset neither hits nor names blocks."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 500, (24,), generator=g).tolist()  # 3 blocks of 8
    reqs = {f"p{i}": (shared + torch.randint(0, 500, (n,), generator=g).tolist(),
                      SamplingParams(temperature=0.0, max_tokens=NEW)) for i, n in enumerate([3, 9, 5, 12])}
    off = LLMEngine(EngineConfig(str(model_dir), pool_bytes=64 << 20, block_size=8, prefix_caching=False))
    expected = {f"p{i}": r.token_ids for i, r in enumerate(off.generate([p for p, _ in reqs.values()],
                                                                          [s for _, s in reqs.values()]))}
    loop, a, b = pair(model_dir)
    for m in (a, b):  # each member holds the shared prefix cached
        m.engine.generate([shared + [1]], SamplingParams(temperature=0.0, max_tokens=2))
    for i, (rid, (prompt, params)) in enumerate(reqs.items()):
        (a if i % 2 == 0 else b).engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):
        for m in (a, b):
            collect(tokens, m.engine.step())
    assert all(m.engine.prefix_cache.hit_stats()[1] >= 6 for m in (a, b))  # two requests x 3 blocks each
    stages = [Stage("a", range(0, 2)), Stage("b", range(2, LAYERS))]
    a.join("g", stages), b.join("g", stages)
    assert set(a.victims) == {"p0", "p2"} and set(b.victims) == {"p1", "p3"}
    assert all(not m.engine.prefix_cache.enabled and m.engine.prefix_cache.held_hashes() == [] for m in (a, b))
    drive(loop, [a, b], tokens, kv_every=4)
    assert tokens == expected
    for m in (a, b):
        assert m.engine.blocks.num_used_blocks == 0 and not m.exchanging
