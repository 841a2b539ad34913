"""Choose the next token of each sampling sequence from its logits.

Greedy rows take the argmax. Random rows are scaled by temperature, filtered by top-k
and top-p (one sort for the whole batch), and drawn by exponential-race sampling
(argmax(p / E), E ~ Exp(1)) with noise from a generator seeded by (the request's seed,
the index of the output token being drawn). The noise is a function of those two numbers,
not of a generator's history, so a seeded request gets the same tokens whatever else is
in the batch, after a preemption, and when another worker resumes it mid-stream.
Logprobs are of the model's distribution (before temperature and filters), as in vLLM.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from services.gpu_worker.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)  # of the chosen token, when asked
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded `seed` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: manual_seed takes it on every device


class Sampler:
    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}  # unseeded requests: a random seed drawn once
        self._drawn: dict[str, int] = {}  # draws so far, when the caller passes no indices
        self._unseeded = random.Random()
        self._gens: dict[torch.device, torch.Generator] = {}

    def forget(self, seq_id: str) -> None:
        """The request finished: drop what the sampler kept for it."""
        self._seeds.pop(seq_id, None)
        self._drawn.pop(seq_id, None)

    def _seed(self, seq_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        seed = self._seeds.get(seq_id)
        if seed is None:
            seed = self._seeds[seq_id] = self._unseeded.getrandbits(63)
        return seed

    def _generator(self, seed: int, index: int, device: torch.device) -> torch.Generator:
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device=device)
        gen.manual_seed(noise_seed(seed, index))
        return gen

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams], indices: list[int] | None = None,
    ) -> SampleResult:
        """`logits[i]` belongs to `seq_ids[i]` with `params[i]`; it draws that request's output token
        number `indices[i]` (default: one more than the sampler drew for it before)."""
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"sampler: logits {tuple(logits.shape)} for {len(seq_ids)} sequences / {len(params)} params")
        n, vocab = logits.shape
        if n == 0:
            return SampleResult([])
        logits = logits.float()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        chosen = logits.argmax(dim=-1)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = _filtered(logits[rows], [params[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                seq_id = seq_ids[i]
                if indices is not None:
                    index = indices[i]
                else:
                    index = self._drawn.get(seq_id, 0)
                    self._drawn[seq_id] = index + 1
                noise[j].exponential_(generator=self._generator(self._seed(seq_id, params[i]), index, logits.device))
            chosen[rows] = (probs / noise).argmax(dim=-1)
        result = SampleResult(chosen.tolist())
        want = [p.logprobs for p in params]
        if any(w is not None for w in want):
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            k = max(w or 0 for w in want)
            top_vals, top_ids = (logprobs.topk(k, dim=-1) if k else (None, None))
            for i, w in enumerate(want):
                result.logprobs.append(picked[i] if w is not None else None)
                if w:
                    ids = top_ids[i, :w].tolist()
                    vals = top_vals[i, :w].tolist()
                    result.top_logprobs.append(list(zip(ids, vals)))
                else:
                    result.top_logprobs.append(None)
        else:
            result.logprobs = [None] * n
            result.top_logprobs = [None] * n
        return result


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k and top-p masks (-inf outside), for the random rows."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    use_k = any(p.top_k for p in params)
    use_p = any(p.top_p < 1 for p in params)
    if not (use_k or use_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([p.top_k if p.top_k else vocab for p in params], device=logits.device)
        beyond_k = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(beyond_k, float("-inf"))
    if use_p:
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
