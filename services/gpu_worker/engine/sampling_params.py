"""How one request wants its tokens chosen and when it stops. Pure and validated."""
from __future__ import annotations

from dataclasses import dataclass


GUIDED_KINDS = frozenset({"json_schema", "json_object", "regex", "choice", "lark"})


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 (or -1) keeps the whole vocabulary
    seed: int | None = None  # per-request generator: same seed, same tokens, any batch
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop condition (EOS, stop ids, stop strings) before this many
    logprobs: int | None = None  # None: none; 0: chosen token only; N: also the top N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # subtracted once from each token already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; a prompt or output token's logit divided (>0) or multiplied (<0) by it
    min_p: float = 0.0  # tokens less likely than min_p x the top token's probability are dropped, in [0, 1]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    guided: tuple[str, str] | None = None  # (kind, spec): structured output (engine/structured.py)

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items()))
        else:
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias))
        if self.guided is not None:
            object.__setattr__(self, "guided", tuple(self.guided))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"sampling parameter {name}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", f"must be a non-negative integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be None or an integer in [0, 20], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                bad(name, f"must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            bad("logit_bias", "token ids must be >= 0 and biases in [-100, 100]")
        if self.guided is not None and (len(self.guided) != 2 or self.guided[0] not in GUIDED_KINDS):
            bad("guided", f"must be (kind, spec) with kind one of {sorted(GUIDED_KINDS)}, got {self.guided!r}")

    @property
    def penalized(self) -> bool:
        """Whether any repetition control is on (the sampler then counts the sequence's tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_stop_len(self) -> int:
        """Longest stop string: how much text the detokenizer may have to hold back."""
        return max((len(s) for s in self.stop), default=0)
