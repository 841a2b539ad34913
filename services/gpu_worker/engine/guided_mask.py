"""Per-sequence grammar state and the token masks it puts on the batch's logits.

    masks = GuidedMasks(tokenizer)
    masks.apply(logits, rows, seq_ids, params, outputs)   # -inf on every token the grammar refuses
    masks.forget(seq_id)

Each guided sequence has an llguidance matcher that follows the sequence's *output tokens*, not
the sampler's history: before a mask is computed the matcher consumes whatever tokens the
sequence gained since (so a preempted, migrated or resumed sequence catches up by itself). The
masks of a step are computed into one int32 bitmask on the CPU (a row per guided sequence; the
others in the batch are untouched) and applied on the logits' device in one vectorized unpack.
A matcher in an error state (a grammar refused late, a resumed sequence whose tokens it rejects)
allows only end-of-sequence tokens, so the sequence ends instead of running on unconstrained.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.structured import GrammarError, grammar_of
from services.gpu_worker.engine.tokenizer import EngineTokenizer


# tokenizer -> (logits width, eos ids) -> its llguidance tokenizer (gone with the tokenizer)
_SHARED: weakref.WeakKeyDictionary[EngineTokenizer, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = \
    weakref.WeakKeyDictionary()


@dataclass
class _Guide:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has seen


class GuidedMasks:
    def __init__(self, tokenizer: EngineTokenizer | None, eos_token_ids: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = sorted(eos_token_ids if eos_token_ids is not None else
                          (tokenizer.eos_token_ids if tokenizer is not None else ()))
        self._tokenizers: dict[int, llguidance.LLTokenizer] = {}  # by logits width
        self._guides: dict[str, _Guide] = {}
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def forget(self, seq_id: str) -> None:
        self._guides.pop(seq_id, None)

    def _lltokenizer(self, vocab: int) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer: built on the first guided request (about 2 s for a 49k
        vocabulary), then shared by every sampler of that tokenizer in the process."""
        tok = self._tokenizers.get(vocab)
        if tok is None:
            if self.tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer, and this engine has none")
            shared = _SHARED.setdefault(self.tokenizer, {})
            key = (vocab, tuple(self.eos))
            tok = shared.get(key)
            if tok is None:
                tok = shared[key] = llguidance.LLTokenizer(
                    self.tokenizer.tok.to_str(), n_vocab=max(vocab, self.tokenizer.vocab_size),
                    eos_token=self.eos or None)
            self._tokenizers[vocab] = tok
        return tok

    def _guide(self, seq_id: str, params: SamplingParams, vocab: int) -> _Guide:
        guide = self._guides.get(seq_id)
        if guide is None:
            assert params.guided is not None
            kind, spec = params.guided
            try:
                grammar = grammar_of(kind, spec)
            except GrammarError as exc:  # the gateway checks first: only a direct engine caller gets here
                grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {json.dumps(str(exc))}")
            guide = self._guides[seq_id] = _Guide(llguidance.LLMatcher(self._lltokenizer(vocab), grammar, log_level=0))
        return guide

    def apply(self, logits: torch.Tensor, rows: list[int], seq_ids: list[str], params: list[SamplingParams],
              outputs: list[list[int]]) -> None:
        """Mask `logits[rows[j]]` in place with sequence `rows[j]`'s grammar after its `outputs`."""
        if not rows:
            return
        vocab = logits.shape[1]
        bitmask = allocate_token_bitmask(len(rows), max(vocab, self._lltokenizer(vocab).vocab_size))
        eos_only: list[int] = []
        for j, i in enumerate(rows):
            guide = self._guide(seq_ids[i], params[i], vocab)
            seen = outputs[i]
            if len(seen) < guide.consumed:  # rolled back (a recompute from fewer tokens): start over
                guide.matcher.reset()
                guide.consumed = 0
            if len(seen) > guide.consumed:
                guide.matcher.consume_tokens(list(seen[guide.consumed:]))
                guide.consumed = len(seen)
            if guide.matcher.is_error():
                eos_only.append(j)
            else:
                fill_next_token_bitmask(guide.matcher, bitmask, j)
        refused = ~self._unpack(bitmask, vocab, logits.device)
        if eos_only:
            refused[eos_only] = True
            for eos in self.eos:
                if eos < vocab:
                    refused[eos_only, eos] = False
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(refused, float("-inf"))
        else:  # in place on each row's view: no gather/scatter copies of the batch
            for j, i in enumerate(rows):
                logits[i].masked_fill_(refused[j], float("-inf"))

    def _unpack(self, bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
        """[rows, words] int32 -> [rows, vocab] bool (bit b of word w: token 32 w + b)."""
        if device.type == "cpu":  # numpy's unpackbits: ~20x the shifts below on a CPU
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            return torch.from_numpy(bits[:, :vocab].view(np.bool_))
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, device=device, dtype=torch.int32)
        words = bitmask.to(device, non_blocking=True)
        return ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]


__all__ = ["GuidedMasks"]
