"""Live KV migration between two real engines (CPU, generated checkpoint): Llumnix pre-copy
done in process — full blocks copied while the source decodes, a short stop for the tail —
must continue exactly like a run that never moved."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import DetachedRequest, EngineConfig, KvProgress, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

LONG = "A hacker is a person who enjoys exploring the details of programmable systems and how to stretch them."
SHORT = "The Jargon File is a glossary of hacker slang."
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"), layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=3)


@pytest.fixture(scope="module")
def lora_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(tmp_path_factory.mktemp("lora"), model_dir, rank=8, targets=["q", "k", "v", "o", "up"], seed=5)


def engine(model_dir: Path, lora: Path | None = None, **kw: object) -> LLMEngine:
    eng = LLMEngine(EngineConfig(str(model_dir), **{"pool_bytes": 64 << 20, "block_size": BLOCK, **kw}))
    if lora is not None:
        eng.add_lora("a", lora)
    return eng


@dataclass
class Stream:
    """What a client of request `rid` receives, across engines."""

    rid: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    completion_tokens: int = 0

    def step(self, eng: LLMEngine) -> None:
        for out in eng.step():
            if out.request_id == self.rid:
                assert not self.finished, "output after the final one"
                self.tokens += out.new_token_ids
                self.text += out.new_text
                self.finished, self.completion_tokens = out.finished, out.completion_tokens


def copy_blocks(src: LLMEngine, dst: LLMEngine, rid: str, first: int, last: int) -> None:
    """The data plane's byte stream: the same rows in the same order on both sides, though cut into
    different runs of consecutive block ids (a source on shared prefix blocks has more of them)."""
    sviews, dviews = src.kv_views(rid, first, last), dst.kv_views(rid, first, last)
    if not sviews:
        assert not dviews
        return
    rows = torch.cat(sviews)
    assert rows.shape[0] == sum(d.shape[0] for d in dviews) and rows.shape[1:] == dviews[0].shape[1:]
    at = 0
    for d in dviews:
        d.copy_(rows[at:at + d.shape[0]])
        at += d.shape[0]


def unmigrated(model_dir: Path, lora: Path | None, prompt: str, params: SamplingParams, adapter: str | None, **kw: object) -> Stream:
    eng, ref = engine(model_dir, lora, **kw), Stream("r")
    eng.add_request("r", prompt, params, adapter=adapter)
    while eng.has_unfinished:
        ref.step(eng)
    return ref


def migrate(a: LLMEngine, b: LLMEngine, prompt: str, params: SamplingParams, adapter: str | None,
            warm_steps: int, precopy_steps: int, tamper: bool = False) -> tuple[Stream, DetachedRequest]:
    """The pre-copy protocol, in process: what the workers do over the data plane."""
    stream = Stream("r")
    a.add_request("r", prompt, params, adapter=adapter)
    for _ in range(warm_steps):
        stream.step(a)
    expected = a.kv_progress("r").num_tokens + params.max_tokens  # a hint: keeps B's chain contiguous
    copied = 0
    for _ in range(precopy_steps):  # stage copies of the blocks that are full, while A decodes
        p = a.kv_progress("r")
        assert p is not None and p.num_blocks >= p.full_blocks
        assert b.reserve_kv("r", p.num_computed_tokens, expected_tokens=expected) is not None
        copy_blocks(a, b, "r", copied, p.full_blocks)
        copied = p.full_blocks
        stream.step(a)
    assert copied > 0
    used_before = a.blocks.num_used_blocks
    d = a.detach("r", keep_kv=True)  # the stop: no output, blocks kept for the tail copy
    assert d is not None and a.kv_progress("r") is None and a.blocks.num_used_blocks == used_before
    assert d.output_token_ids == stream.tokens and not a.step()  # nothing emitted for it
    tail = -(-d.num_computed_tokens // BLOCK)
    assert b.reserve_kv("r", d.num_computed_tokens) is not None  # grown to the final size
    copy_blocks(a, b, "r", copied, tail)
    if tamper:  # negative control: the destination's KV is not what the source computed
        for view in b.kv_views("r", 0, tail):
            view.normal_(generator=torch.Generator().manual_seed(0))
    b.attach("r", d.prompt_token_ids, d.params, output_token_ids=d.output_token_ids,
             num_computed_tokens=d.num_computed_tokens, adapter=d.adapter, priority=d.priority)
    assert a.release_kv("r") == used_before and a.blocks.num_used_blocks == 0 and a.release_kv("r") == 0
    assert b.kv_progress("r").num_computed_tokens == d.num_computed_tokens
    stream.step(b)  # the first step on B computes only what A had not: no re-prefill
    step = 1 if d.output_token_ids else min(b.config.max_prefill_chunk or 1 << 30, len(d.prompt_token_ids) - d.num_computed_tokens)
    assert b.kv_progress("r").num_computed_tokens == d.num_computed_tokens + step
    while b.has_unfinished:
        stream.step(b)
    assert b.blocks.num_used_blocks == 0
    return stream, d


@pytest.mark.parametrize(
    ("where", "params", "with_lora"),
    [("decode", GREEDY, False), ("decode", SEEDED, False), ("decode", GREEDY, True),
     ("prefill", GREEDY, False), ("prefill", SEEDED, True)],
)
def test_precopy_migration_continues_exactly(model_dir: Path, lora_dir: Path, where: str, params: SamplingParams,
                                              with_lora: bool) -> None:
    lora, adapter = (lora_dir, "a") if with_lora else (None, None)
    kw: dict[str, object] = {"max_prefill_chunk": 4} if where == "prefill" else {}
    ref = unmigrated(model_dir, lora, LONG, params, adapter, **kw)
    a, b = engine(model_dir, lora, **kw), engine(model_dir, lora, **kw)
    got, d = migrate(a, b, LONG, params, adapter, warm_steps=2 if where == "prefill" else 5, precopy_steps=3)
    if where == "prefill":
        assert d.output_token_ids == [] and 0 < d.num_computed_tokens < len(d.prompt_token_ids)
    else:
        assert len(d.output_token_ids) == 8 and d.num_computed_tokens == len(d.prompt_token_ids) + 7
    assert got.tokens == ref.tokens and len(got.tokens) == params.max_tokens
    assert got.text == ref.text  # the destination's detokenizer replayed the outputs: no text repeated
    assert got.finished and got.completion_tokens == params.max_tokens


def test_the_copied_kv_is_what_the_destination_uses(model_dir: Path) -> None:
    """Negative control: with the copied blocks overwritten, the continuation differs."""
    ref = unmigrated(model_dir, None, LONG, GREEDY, None)
    got, _ = migrate(engine(model_dir), engine(model_dir), LONG, GREEDY, None, warm_steps=5, precopy_steps=3, tamper=True)
    assert got.tokens[:8] == ref.tokens[:8] and got.tokens != ref.tokens


def test_lora_changes_the_tokens(model_dir: Path, lora_dir: Path) -> None:
    """Guard: the LoRA cases above would prove nothing if the adapter did not matter."""
    assert unmigrated(model_dir, lora_dir, LONG, GREEDY, "a").tokens != unmigrated(model_dir, None, LONG, GREEDY, None).tokens


def test_detach_keep_kv_then_attach_back_continues_exactly(model_dir: Path) -> None:
    """The failed-migration path: the request resumes on the source, from its held blocks."""
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref_eng = engine(model_dir)
    expected = [r.token_ids for r in ref_eng.generate([LONG, SHORT], [GREEDY, other])]
    eng = engine(model_dir)
    eng.add_request("r", LONG, GREEDY)
    eng.add_request("n", SHORT, other)
    mine, neighbour = Stream("r"), Stream("n")
    for _ in range(4):
        for out in eng.step():
            (mine if out.request_id == "r" else neighbour).tokens += out.new_token_ids
    d = eng.detach("r", keep_kv=True)
    assert d is not None and d.tables and d.num_computed_tokens == len(d.prompt_token_ids) + 3
    held = {layer: list(ids) for layer, ids in d.tables.items()}
    before = [v.clone() for v in eng.kv_views("r", 0, len(held[0]))]
    with pytest.raises(ValueError, match="holds KV"):
        eng.add_request("r", LONG, GREEDY)
    # Held blocks are outside the scheduler and the pool's reach while others keep running.
    assert eng.blocks.give_back(1 << 40) > 0 and eng.blocks.block_tables("r") == held
    for _ in range(3):
        for out in eng.step():
            assert out.request_id == "n"
            neighbour.tokens += out.new_token_ids
    assert all(torch.equal(x, y) for x, y in zip(before, eng.kv_views("r", 0, len(held[0])), strict=True))
    eng.attach("r", d.prompt_token_ids, d.params, output_token_ids=d.output_token_ids,
               num_computed_tokens=d.num_computed_tokens, adapter=d.adapter, priority=d.priority)
    assert eng.release_kv("r") == 0  # attached: its blocks are the running request's now
    while eng.has_unfinished:
        for out in eng.step():
            (mine if out.request_id == "r" else neighbour).tokens += out.new_token_ids
    assert mine.tokens == expected[0] and neighbour.tokens == expected[1]
    assert eng.blocks.num_used_blocks == 0


def test_detach_without_kv_frees_now_and_attach_recomputes(model_dir: Path) -> None:
    ref = unmigrated(model_dir, None, SHORT, GREEDY, None)
    eng, got = engine(model_dir), Stream("r")
    eng.add_request("r", SHORT, GREEDY)
    for _ in range(5):
        got.step(eng)
    d = eng.detach("r", keep_kv=False)
    assert d is not None and d.tables == {} and d.num_computed_tokens == 0 and eng.blocks.num_used_blocks == 0
    assert eng.release_kv("r") == 0
    eng.attach("r", d.prompt_token_ids, d.params, output_token_ids=d.output_token_ids, num_computed_tokens=0)
    while eng.has_unfinished:
        got.step(eng)
    assert got.tokens == ref.tokens and got.text == ref.text


def test_unknown_ids_release_and_progress(model_dir: Path) -> None:
    eng = engine(model_dir)
    assert eng.detach("nope", keep_kv=True) is None and eng.kv_progress("nope") is None
    assert eng.release_kv("nope") == 0
    eng.add_request("run", SHORT, GREEDY)
    eng.step()
    p = eng.kv_progress("run")
    assert isinstance(p, KvProgress) and p.num_tokens == len(eng._requests["run"].seq.prompt_token_ids) + 1
    assert p.num_computed_tokens == p.num_tokens - 1 and p.full_blocks == p.num_computed_tokens // BLOCK
    assert p.num_blocks == len(p.tables[0]) == len(p.tables[1]) >= p.full_blocks
    used = eng.blocks.num_used_blocks
    assert eng.release_kv("run") == 0 and eng.blocks.num_used_blocks == used  # a running request is not held
    with pytest.raises(ValueError, match="running"):
        eng.reserve_kv("run", 8)
    tables = eng.reserve_kv("in", 10)
    assert tables is not None and sorted(tables) == [0, 1] and all(len(t) == 3 for t in tables.values())
    assert eng.blocks.num_used_blocks == used + 6
    grown = eng.reserve_kv("in", 30)
    assert grown is not None and all(grown[l][:3] == tables[l] and len(grown[l]) == 8 for l in grown)
    assert eng.kv_progress("in") is None  # reserved, not in the engine
    with pytest.raises(ValueError, match="holds KV"):
        eng.add_request("in", SHORT, GREEDY)
    assert eng.release_kv("in") == 16 and eng.blocks.num_used_blocks == used
    eng.add_request("in", SHORT, GREEDY)  # a released id is an ordinary id again


def test_reserve_without_room_allocates_nothing(model_dir: Path) -> None:
    eng = engine(model_dir, kv_blocks=20)  # 2 layers: 10 blocks each, 40 tokens
    assert eng.reserve_kv("big", 41) is None and eng.blocks.num_used_blocks == 0 and not eng.blocks.has("big")
    first = eng.reserve_kv("x", 16)
    assert first is not None and eng.blocks.num_used_blocks == 8
    assert eng.reserve_kv("x", 80) is None  # growing past the room: refused, the earlier blocks stay
    assert eng.blocks.num_used_blocks == 8 and eng.blocks.block_tables("x") == first
    assert eng.release_kv("x") == 8 and eng.blocks.num_used_blocks == 0


def test_attach_refusals_name_the_problem_and_leak_nothing(model_dir: Path) -> None:
    eng = engine(model_dir)
    prompt = eng.tokenizer.encode(LONG)
    assert eng.reserve_kv("m", 8) is not None
    used = eng.blocks.num_used_blocks

    def refused(match: str, **kw: object) -> None:
        args: dict[str, object] = {"output_token_ids": [5, 6], "num_computed_tokens": 8, **kw}
        with pytest.raises(ValueError, match=match):
            eng.attach(args.pop("rid", "m"), args.pop("prompt", prompt), GREEDY, **args)  # type: ignore[arg-type]
        assert eng.kv_progress("m") is None and not eng.has_unfinished and eng.blocks.num_used_blocks == used

    refused("cover 8 tokens, fewer than num_computed_tokens=20", num_computed_tokens=20)
    refused("reserve_kv first", rid="other", num_computed_tokens=4)
    refused("unknown LoRA adapter", adapter="nope")
    refused("vocabulary", output_token_ids=[5, 99999])
    refused("num_computed_tokens must be", num_computed_tokens=len(prompt) + 2)
    refused("nothing to generate", output_token_ids=[5] * GREEDY.max_tokens)
    assert eng.release_kv("m") == used and eng.blocks.num_used_blocks == 0


def test_full_blocks_never_change_while_decoding(model_dir: Path) -> None:
    eng = engine(model_dir)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("r", LONG, long)
    eng.add_request("n", SHORT, long)  # a neighbour decoding in the same batches
    for _ in range(3):
        eng.step()
    p = eng.kv_progress("r")
    assert p is not None and p.full_blocks >= 10
    snapshot = [v.clone() for v in eng.kv_views("r", 0, p.full_blocks)]
    whole = [v.clone() for v in eng.kv_views("r", 0, p.num_blocks)]
    for _ in range(10):
        eng.step()
    later = eng.kv_progress("r")
    assert later is not None and later.full_blocks > p.full_blocks and later.num_preemptions == 0
    assert all(later.tables[l][: p.full_blocks] == p.tables[l][: p.full_blocks] for l in p.tables)
    assert all(torch.equal(x, y) for x, y in zip(snapshot, eng.kv_views("r", 0, p.full_blocks), strict=True))
    # the tail block is still being written: the guard is not vacuous
    assert not all(torch.equal(x, y) for x, y in zip(whole, eng.kv_views("r", 0, p.num_blocks), strict=True))
    with pytest.raises(ValueError, match="outside"):
        eng.kv_views("r", 0, later.num_blocks + 1)


@pytest.mark.parametrize("params", [GREEDY, SEEDED])
def test_migration_of_a_request_on_shared_prefix_blocks(model_dir: Path, params: SamplingParams) -> None:
    """Prefix caching on both sides: the source's request runs on cached blocks it shares, the
    destination holds the same prefix cached. The copy lands in fresh blocks there (re-named after
    its first step, never written into the destination's cached ones) and every later hit on either
    side still gives the unmigrated tokens."""
    ref = unmigrated(model_dir, None, LONG, params, None, prefix_caching=False)
    a, b = engine(model_dir), engine(model_dir)
    for eng in (a, b):  # both hold LONG's blocks cached
        assert [r.token_ids for r in eng.generate([LONG], params)] == [ref.tokens]
    a_hits = a.prefix_cache.hit_stats()[1]
    got, d = migrate(a, b, LONG, params, None, warm_steps=5, precopy_steps=3)
    assert a.prefix_cache.hit_stats()[1] > a_hits  # the source ran on its cached prefix
    assert got.tokens == ref.tokens
    for eng in (a, b):  # nothing cached was corrupted by the copy or the release
        before = eng.prefix_cache.hit_stats()[1]
        assert [r.token_ids for r in eng.generate([LONG], params)] == [ref.tokens]
        assert eng.prefix_cache.hit_stats()[1] > before
