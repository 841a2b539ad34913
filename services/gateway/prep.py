"""From an OpenAI request to token ids and sampling parameters, within the gateway's limits. Pure.

Every refusal is an `ApiError` naming the parameter at fault: a prompt or max_tokens that
does not fit the model's context is 400 `context_length_exceeded`; anything else out of
bounds is 400 `invalid_request_error`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from services.gateway.api_chat import ChatMessage
from services.gateway.api_common import StreamOptions
from services.gateway.api_completions import MAX_PROMPTS
from services.gateway.errors import ApiError
from shared.config import GatewayLimits
from services.gateway.tool_calls import history_message
from shared.events.common import Guided, SamplingParams, TokenBias

SEED_SPACE = 2**63  # SamplingParams.seed is < 2**63
T = TypeVar("T")


class Encoder(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]: ...


@dataclass(frozen=True)
class Knobs:
    """The sampling fields completions and chat share, already decoded and type-checked."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int | None
    n: int
    stop: str | list[str] | None
    seed: int | None
    logprobs: int | None  # None: none; 0: chosen token only; N: N alternatives too
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    max_tokens_param: str = "max_tokens"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    guided: Guided | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


def or_default(value: T | None, default: T) -> T:
    """`null` and absent alike: the field's default."""
    return default if value is None else value


def logit_bias_of(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"<token id>": bias}` as (id, bias) pairs, each id inside the vocabulary."""
    out = []
    for key, value in (bias or {}).items():
        token = int(key)
        if token >= vocab_size:
            raise ApiError.bad_request(f"logit_bias names token {token}, outside the vocabulary (size {vocab_size})",
                                       param="logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def completion_prompts(prompt: str | list[str | int | list[int]], tok: Encoder) -> list[list[int]]:
    """OpenAI's four prompt shapes -> one token-id list per prompt."""
    if isinstance(prompt, str):
        return [_encode(prompt, tok)]
    if all(isinstance(p, int) for p in prompt):
        return [_check_ids(prompt, tok)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise ApiError.bad_request(f"prompt takes at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}",
                                   param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_encode(p, tok) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        return [_check_ids(p, tok) for p in prompt]  # type: ignore[arg-type]
    raise ApiError.bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists "
        "(not a mix)", param="prompt",
    )


def _encode(text: str, tok: Encoder) -> list[int]:
    ids = tok.encode(text)
    if not ids:
        raise ApiError.bad_request("prompt must not be empty", param="prompt")
    return ids


def _check_ids(ids: list[int], tok: Encoder) -> list[int]:
    bad = next((i for i in ids if i >= tok.vocab_size), None)
    if bad is not None:
        raise ApiError.bad_request(f"prompt token id {bad} is outside the vocabulary (size {tok.vocab_size})",
                                   param="prompt")
    return list(ids)


def chat_prompt(messages: list[ChatMessage], tok: Encoder, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    turns = [history_message(m) for m in messages]
    try:
        ids = tok.encode_chat(turns, add_generation_prompt, tools) if tools else \
            tok.encode_chat(turns, add_generation_prompt)
    except Exception as exc:  # the model's own jinja template refused the conversation
        raise ApiError.bad_request(f"the model's chat template cannot render these messages: {exc}"[:1024],
                                   param="messages") from None
    if not ids:
        raise ApiError.bad_request("messages render to an empty prompt", param="messages")
    return ids


def check_request(knobs: Knobs, limits: GatewayLimits) -> None:
    """Bounds that do not depend on the prompt."""
    if knobs.n > limits.max_n:
        raise ApiError.bad_request(f"n must be at most {limits.max_n}, got {knobs.n}", param="n")
    if knobs.max_tokens is not None and knobs.max_tokens > limits.max_tokens:
        raise ApiError.bad_request(f"{knobs.max_tokens_param} must be at most {limits.max_tokens}, got "
                                   f"{knobs.max_tokens}", param=knobs.max_tokens_param)
    stops = stop_list(knobs.stop)
    if len(stops) > limits.max_stop_sequences:
        raise ApiError.bad_request(f"stop takes at most {limits.max_stop_sequences} sequences, got {len(stops)}",
                                   param="stop")
    if knobs.max_tokens is not None and knobs.min_tokens > knobs.max_tokens:
        raise ApiError.bad_request(f"min_tokens ({knobs.min_tokens}) must be at most {knobs.max_tokens_param} "
                                   f"({knobs.max_tokens})", param="min_tokens")


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    """vLLM's rules: stream_options only with stream; continuous usage stats are not sent."""
    if options is None:
        return
    if not stream:
        raise ApiError.bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if options.continuous_usage_stats:
        raise ApiError.bad_request("'stream_options.continuous_usage_stats' is not supported by this server: usage "
                                   "is sent once, at the end (include_usage).", param="stream_options")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_for(knobs: Knobs, *, prompt_len: int, max_context: int, limits: GatewayLimits, prompt_param: str,
                 choice: int = 0) -> SamplingParams:
    """The sampling parameters of one sequence; max_tokens defaults to what the context leaves."""
    if prompt_len > limits.max_prompt_tokens:
        raise ApiError.context_length(
            f"The prompt is {prompt_len} tokens; this gateway accepts at most {limits.max_prompt_tokens} "
            "(max_prompt_tokens).",
            param=prompt_param)
    room = max_context - prompt_len
    if room < 1:
        raise ApiError.context_length(
            f"This model's maximum context length is {max_context} tokens; the prompt alone is {prompt_len} "
            "tokens.", param=prompt_param)
    if knobs.max_tokens is None:
        max_tokens = min(room, limits.max_tokens)
    elif knobs.max_tokens > room:
        raise ApiError.context_length(
            f"This model's maximum context length is {max_context} tokens; you requested {prompt_len + knobs.max_tokens}"
            f" ({prompt_len} in the prompt, {knobs.max_tokens} for the completion).", param=knobs.max_tokens_param)
    else:
        max_tokens = knobs.max_tokens
    if knobs.min_tokens > max_tokens:
        raise ApiError.bad_request(f"min_tokens ({knobs.min_tokens}) exceeds the {max_tokens} tokens the context "
                                   "leaves", param="min_tokens")
    seed = None if knobs.seed is None else (knobs.seed + choice) % SEED_SPACE  # n > 1: distinct, reproducible
    return SamplingParams(
        max_tokens=max_tokens, temperature=knobs.temperature, top_p=knobs.top_p,
        top_k=max(0, knobs.top_k or 0), seed=seed, stop=stop_list(knobs.stop),
        stop_token_ids=list(knobs.stop_token_ids), ignore_eos=knobs.ignore_eos, min_tokens=knobs.min_tokens,
        logprobs=knobs.logprobs, presence_penalty=knobs.presence_penalty, frequency_penalty=knobs.frequency_penalty,
        repetition_penalty=knobs.repetition_penalty, min_p=knobs.min_p,
        logit_bias=[TokenBias(token_id=t, bias=b) for t, b in knobs.logit_bias], guided=knobs.guided,
        include_stop_str_in_output=knobs.include_stop_str_in_output, skip_special_tokens=knobs.skip_special_tokens,
    )


__all__ = ["Knobs", "chat_prompt", "check_request", "check_stream_options", "completion_prompts", "logit_bias_of", "or_default", "sampling_for",
           "stop_list"]
