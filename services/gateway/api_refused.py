"""Request fields of OpenAI's and vLLM's servers that this gateway does not implement: each one is
declared (so it is documented, and not "unknown"), and refused with a 400 naming it when it asks
for something — a value equal to the field's off state (`store: false`, `modalities: ["text"]`,
`use_beam_search: false`, ...) or `null` is taken. A field that is neither implemented nor listed
here is refused as unknown (the request structs forbid unknown fields). docs/api.md has the table.
"""
from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import ApiError

# name -> (values that ask for nothing, why it is refused)
COMMON: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1, 1.0), "it applies to beam search, which is not implemented"),
    "truncate_prompt_tokens": ((), "prompts are never truncated; a prompt too long is refused"),
    "prompt_logprobs": ((), "prompt logprobs are not computed"),
    "allowed_token_ids": ((), "use logit_bias"),
    "bad_words": ((), "use logit_bias"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer does"),
    "logits_processors": ((), "custom logits processors are not loaded"),
    "guided_decoding_backend": (("guidance", "auto"), "llguidance is the only backend"),
    "guided_whitespace_pattern": ((), "JSON is generated with fixed whitespace"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "return_token_ids": ((False,), "tokens are returned as text"),
    "cache_salt": ((), "the prefix cache is not salted per request"),
    "kv_transfer_params": ((), "disaggregated prefill is not served here"),
    "vllm_xargs": ((), "no extension arguments are read"),
    "priority": ((0,), "priorities are set by the cluster's scheduler, not per request"),
    "request_id": ((), "the gateway names requests itself"),
    "service_tier": (("auto", "default"), "one service tier"),
    "store": ((False,), "completions are not stored"),
    "metadata": ((), "completions are not stored (metadata needs store)"),
    "prompt_cache_key": ((), "prefix caching needs no key"),
    "prompt_cache_retention": ((), "prefix caching needs no key"),
    "prompt_cache_options": ((), "prefix caching needs no key"),
    "moderation": ((), "no moderation runs here"),
    "mm_processor_kwargs": ((), "only text is served"),
}
CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    **COMMON,
    "audio": ((), "only text is served"),
    "modalities": ((["text"],), "only text is served"),
    "prediction": ((), "predicted outputs are not implemented"),
    "functions": ((), "deprecated by OpenAI: send tools"),
    "function_call": ((), "deprecated by OpenAI: send tool_choice"),
    "reasoning_effort": ((), "the served models are not reasoning models"),
    "verbosity": ((), "the served models have no verbosity control"),
    "web_search_options": ((), "no web search"),
    "echo": ((False,), "chat echo is not implemented (the completions API has it)"),
    "continue_final_message": ((False,), "a final assistant message is not continued"),
    "add_special_tokens": ((False,), "the chat template adds what the model needs"),
    "documents": ((), "the chat template is given no documents"),
    "chat_template": ((), "the model's own chat templates only"),
    "chat_template_kwargs": ((), "the model's own chat templates only"),
}
COMPLETION: dict[str, tuple[tuple[Any, ...], str]] = {
    **COMMON,
    "suffix": ((), "suffix is not supported (as in vLLM)"),
    "add_special_tokens": ((True,), "prompts are encoded as the tokenizer does"),
}


def _struct(name: str, fields: dict[str, Any]) -> type[msgspec.Struct]:
    return msgspec.defstruct(name, [(f, Any, None) for f in fields], kw_only=True)


RefusedChatFields = _struct("RefusedChatFields", CHAT)
RefusedCompletionFields = _struct("RefusedCompletionFields", COMPLETION)


def refuse_unsupported(data: msgspec.Struct, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """400 naming the first refused field that asks for something."""
    for name, (off, why) in table.items():
        value = getattr(data, name)
        if value is not None and value not in off:
            raise ApiError.bad_request(f"'{name}' is not supported by this server: {why}.", param=name)


__all__ = ["CHAT", "COMPLETION", "RefusedChatFields", "RefusedCompletionFields", "refuse_unsupported"]
