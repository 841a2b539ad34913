"""The workers' token logprobs (ids) in OpenAI's two shapes: completions' and chat's."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.gateway.api_chat import ChatLogprobs, LogprobEntry, TopLogprobEntry
from services.gateway.api_completions import CompletionLogprobs
from shared.events.common import TokenLogprobs


class Pieces(Protocol):
    def piece(self, token_id: int) -> str: ...


def completion_logprobs(entries: Sequence[TokenLogprobs], tok: Pieces, offset: int, with_top: bool) -> CompletionLogprobs:
    """`offset`: characters of the choice's text before these tokens (for `text_offset`)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for entry in entries:
        text = tok.piece(entry.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{tok.piece(t.token_id): t.logprob for t in entry.top} for entry in entries] if with_top else None
    return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries], top_logprobs=top,
                              text_offset=offsets)


def merge_completion(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs(top_logprobs=[] if parts and parts[0].top_logprobs is not None else None)
    for part in parts:
        out.tokens.extend(part.tokens)
        out.token_logprobs.extend(part.token_logprobs)
        out.text_offset.extend(part.text_offset)
        if out.top_logprobs is not None and part.top_logprobs is not None:
            out.top_logprobs.extend(part.top_logprobs)
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs], tok: Pieces) -> ChatLogprobs:
    content: list[LogprobEntry] = []
    for entry in entries:
        text = tok.piece(entry.token_id)
        top = [TopLogprobEntry(token=(t_text := tok.piece(t.token_id)), logprob=t.logprob, bytes=list(t_text.encode()))
               for t in entry.top]
        content.append(LogprobEntry(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


__all__ = ["chat_logprobs", "completion_logprobs", "merge_completion"]
