"""Incremental detokenization: text deltas that never split a UTF-8 character or a stop string.

Decoding token by token can end in the middle of a multi-byte character (byte-level BPE
splits emoji and CJK across tokens) — the decoder then yields U+FFFD, and we wait for
the next token. Text that could still become the start of a stop string is held back
until it is decided; when a stop string appears the text is cut there and the request
stops. The prefix/read offsets follow the usual scheme (vLLM, TGI): decoding a few
tokens of left context keeps tokenizers that encode spaces in the token (SentencePiece)
correct.
"""
from __future__ import annotations

from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.tokenizer import EngineTokenizer

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens of left context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: EngineTokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._max_stop = params.max_stop_len
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_outputs = 0
        self.text = ""  # all decoded output text so far (emitted + held back)
        self._emitted = 0  # chars of self.text already returned
        self.stop_string: str | None = None  # set when a stop string ended the output

    @property
    def output_text(self) -> str:
        """The text returned so far."""
        return self.text[: self._emitted]

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text that is now safe to emit (maybe '')."""
        if self.stop_string is not None:
            return ""
        self._num_outputs += 1
        self._ids.append(token_id)
        self.text += self._decode_new()
        if self._stops and self._num_outputs >= self._min_tokens:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                return self._emit(len(self.text))
            return self._emit(len(self.text) - self._held_back())
        return self._emit(len(self.text))

    def flush(self) -> str:
        """The request ended (not by a stop string): emit whatever was held back."""
        if self.stop_string is None and self._read_offset < len(self._ids):
            self.text += self._decode(self._ids[self._prefix_offset :])[
                len(self._decode(self._ids[self._prefix_offset : self._read_offset])) :
            ]
            self._read_offset = len(self._ids)
        return self._emit(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""  # an incomplete character (or nothing visible yet): wait

    def _find_stop(self) -> int | None:
        """Earliest stop string in the not-yet-emitted text (it may start in held-back text)."""
        start = self._emitted  # held-back text guarantees no stop starts in emitted text
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        self.stop_string = best[1]
        return best[0] + len(best[1]) if self._include_stop else best[0]

    def _held_back(self) -> int:
        """Chars at the end of the text that are a proper prefix of some stop string."""
        pending = len(self.text) - self._emitted
        for k in range(min(self._max_stop - 1, pending), 0, -1):
            tail = self.text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
