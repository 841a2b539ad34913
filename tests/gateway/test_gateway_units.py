"""Unit tests of the gateway's pure parts: rate limits, API keys, request preparation,
error mapping and the catalog view. No I/O."""
from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from litestar.exceptions import ValidationException

from services.gateway.api_chat import ChatMessage, TextPart
from services.gateway.auth import ApiKeys
from services.gateway.catalog import BucketView, ModelCatalog
from services.gateway.errors import ApiError, from_validation
from services.gateway.prep import Knobs, chat_prompt, check_request, completion_prompts, sampling_for
from services.gateway.rate_limit import RateLimiter
from services.gateway.tokenizers import Tokenizer
from services.gpu_worker.engine.tokenizer import EngineTokenizer
from shared.config import GatewayLimits
from shared.events.registry import AdapterRecord, Bucket, CatalogChanged, CatalogEntry, ModelRecord

LIMITS = GatewayLimits(max_prompt_tokens=50, max_tokens=32, max_n=4, max_stop_sequences=2)


# --- rate limits --------------------------------------------------------------------------------
def test_token_bucket_allows_the_burst_then_says_how_long_to_wait() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.take("k", 10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("k", 10.0) == pytest.approx(0.5)  # one token refills in 1/rate seconds
    assert limiter.take("k", 10.25) == pytest.approx(0.25)
    assert limiter.take("k", 10.5) == 0.0
    assert limiter.take("other", 10.5) == 0.0  # buckets are per key


def test_rate_zero_disables_the_limit_and_keys_stay_bounded() -> None:
    assert RateLimiter(rate=0).take("k", 0.0) == 0.0 and not RateLimiter(rate=0).enabled
    limiter = RateLimiter(rate=1.0, burst=1, max_keys=4)
    for i in range(20):
        limiter.take(f"k{i}", float(i) * 0.01)
    assert len(limiter.buckets) <= 4


# --- API keys ------------------------------------------------------------------------------------
def test_api_keys_accept_only_a_configured_bearer_key() -> None:
    keys = ApiKeys(["sk-first-key", "sk-second-key"])
    assert keys.required
    first = keys.check(b"Bearer sk-first-key")
    assert first is not None and first == keys.check(b"bearer sk-first-key")
    assert keys.check(b"Bearer sk-second-key") not in (None, first)
    for bad in (None, b"", b"Bearer", b"Bearer sk-first-ke", b"Basic sk-first-key", b"sk-first-key"):
        assert keys.check(bad) is None
    assert "sk-first-key" not in first  # the id is a digest, never the key
    assert not ApiKeys([]).required


# --- request preparation --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(EngineTokenizer.from_dir(tokenizer_dir), tokenizer_dir)


def knobs(**kw: object) -> Knobs:
    base: dict[str, object] = dict(max_tokens=None, temperature=1.0, top_p=1.0, top_k=None, n=1, stop=None, seed=None,
                                   logprobs=None, min_tokens=0, ignore_eos=False, stop_token_ids=[])
    base.update(kw)
    return Knobs(**base)  # type: ignore[arg-type]


def test_the_four_prompt_shapes(tok: Tokenizer) -> None:
    hello, world = tok.encode("hello"), tok.encode("world")
    assert hello[0] == tok.engine.bos_token_id and len(hello) > 1
    assert completion_prompts("hello", tok) == [hello]
    assert completion_prompts(["hello", "world"], tok) == [hello, world]
    assert completion_prompts([5, 6, 7], tok) == [[5, 6, 7]]
    assert completion_prompts([[5], [6, 7]], tok) == [[5], [6, 7]]
    for bad, fragment in (([5, "a"], "not a mix"), ([[5], "a"], "not a mix"), ([512], "outside the vocabulary")):
        with pytest.raises(ApiError) as err:
            completion_prompts(bad, tok)  # type: ignore[arg-type]
        assert err.value.status == 400 and err.value.param == "prompt" and fragment in err.value.message


def test_chat_renders_the_template_and_its_refusal_is_a_400_on_messages(tok: Tokenizer) -> None:
    ids = chat_prompt([ChatMessage(role="user", content=[TextPart(type="text", text="hi")])], tok)
    assert tok.engine.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    with pytest.raises(ApiError) as err:
        chat_prompt([ChatMessage(role="tool", content="x")], tok)
    assert err.value.status == 400 and err.value.param == "messages" and "tool messages" in err.value.message


def test_max_tokens_defaults_to_what_the_context_leaves_within_the_limit() -> None:
    assert sampling_for(knobs(), prompt_len=10, max_context=20, limits=LIMITS, prompt_param="prompt").max_tokens == 10
    assert sampling_for(knobs(), prompt_len=10, max_context=500, limits=LIMITS, prompt_param="prompt").max_tokens == 32
    assert sampling_for(knobs(max_tokens=5), prompt_len=10, max_context=500, limits=LIMITS,
                        prompt_param="prompt").max_tokens == 5


@pytest.mark.parametrize("kw, prompt_len, param", [
    ({"max_tokens": 11}, 10, "max_tokens"),  # 10 + 11 > 20
    ({"max_tokens": 11, "max_tokens_param": "max_completion_tokens"}, 10, "max_completion_tokens"),
    ({}, 20, "messages"),  # the prompt alone fills the context
    ({}, 51, "messages"),  # over the gateway's max_prompt_tokens
])
def test_context_length_exceeded_names_the_parameter(kw: dict[str, object], prompt_len: int, param: str) -> None:
    with pytest.raises(ApiError) as err:
        sampling_for(knobs(**kw), prompt_len=prompt_len, max_context=20 if prompt_len < 51 else 1000, limits=LIMITS,
                     prompt_param="messages")
    assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", param)


@pytest.mark.parametrize("kw, param", [
    ({"n": 5}, "n"), ({"max_tokens": 33}, "max_tokens"), ({"stop": ["a", "b", "c"]}, "stop"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
])
def test_limits_of_the_gateway_config(kw: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as err:
        check_request(knobs(**kw), LIMITS)
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_request_error", param)


def test_seeded_choices_get_distinct_reproducible_seeds() -> None:
    seeds = [sampling_for(knobs(seed=7, n=3), prompt_len=1, max_context=50, limits=LIMITS, prompt_param="prompt",
                          choice=i).seed for i in range(3)]
    assert seeds == [7, 8, 9]
    top = sampling_for(knobs(top_k=-1, stop="x"), prompt_len=1, max_context=50, limits=LIMITS, prompt_param="prompt")
    assert top.top_k == 0 and top.stop == ["x"]


# --- error mapping ----------------------------------------------------------------------------------
def test_litestar_validation_errors_become_openai_errors_naming_the_param() -> None:
    wrong = from_validation(ValidationException(extra=[{"message": "Expected `int`, got `str`", "key": "n"}]))
    assert (wrong.status, wrong.type, wrong.code, wrong.param) == (400, "invalid_request_error",
                                                                    "invalid_request_error", "n")
    missing = from_validation(ValidationException(extra=[
        {"message": "Object missing required field `messages`", "key": "data"}]))
    assert missing.param == "messages"
    body = msgspec.json.decode(wrong.encode())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert ApiError.queue_full("full", None).headers() == {"retry-after": "1"}
    assert ApiError.unavailable("no_capacity", "x", 2.2).headers() == {"retry-after": "3"}


# --- catalog ---------------------------------------------------------------------------------------
def changed(key: str, revision: int, record: object | None, op: str = "put") -> CatalogChanged:
    bucket = Bucket.ADAPTERS if isinstance(record, AdapterRecord) else Bucket.MODELS
    return CatalogChanged(bucket=bucket, key=key, revision=revision, op=op, record=record, ts=1.0)  # type: ignore[arg-type]


def test_bucket_view_keeps_the_newest_revision() -> None:
    view = BucketView()
    m1 = ModelRecord(name="m", path="/a", num_layers=1, max_context=64)
    m2 = ModelRecord(name="m", path="/b", num_layers=1, max_context=64)
    assert view.apply(changed("m", 2, m2))
    assert not view.apply(changed("m", 1, m1))  # older: ignored
    view.replace([CatalogEntry(bucket=Bucket.MODELS, key="m", revision=1, record=m1)])
    assert view.entries["m"].record == m2  # a stale listing does not roll back a newer event
    view.replace([])
    assert view.entries == {}
    view.apply(changed("m", 3, m1))
    assert view.apply(changed("m", 4, None, op="delete")) and "m" not in view.entries


def test_catalog_resolves_adapters_to_their_base_model() -> None:
    catalog = ModelCatalog()
    base = ModelRecord(name="base", path="/b", num_layers=1, max_context=64)
    lora = AdapterRecord(name="lora", base="base", path="/l", rank=4, targets=["q_proj"])
    orphan = AdapterRecord(name="orphan", base="gone", path="/o", rank=4, targets=["q_proj"])
    catalog.views[Bucket.MODELS].apply(changed("base", 1, base))
    for name, record in (("lora", lora), ("orphan", orphan)):
        catalog.views[Bucket.ADAPTERS].apply(changed(name, 1, record))
    target = catalog.resolve("lora")
    assert target is not None and target.model == base and target.adapter == lora and target.name == "lora"
    assert catalog.resolve("base") is not None and catalog.resolve("base").adapter is None  # type: ignore[union-attr]
    assert catalog.resolve("orphan") is None and catalog.resolve("nope") is None
