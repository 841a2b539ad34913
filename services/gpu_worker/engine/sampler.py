"""Choose the next token of each sampling sequence from its logits.

Greedy rows take the argmax. Random rows are scaled by temperature, filtered by top-k
and top-p (one sort for the whole batch), and drawn by exponential-race sampling
(argmax(p / E), E ~ Exp(1)) with noise from a generator seeded by (the request's seed,
the index of the output token being drawn). The noise is a function of those two numbers,
not of a generator's history, so a seeded request gets the same tokens whatever else is
in the batch, after a preemption, and when another worker resumes it mid-stream.
Logprobs are of the model's distribution (before temperature and filters), as in vLLM.

Before any of that, the controls that change the distribution itself apply to every row that
asks for them, vectorized over those rows: repetition penalty (on prompt and output tokens),
then frequency and presence penalties (output tokens), then logit_bias, then the grammar's token
mask of a structured-output request (guided_mask.py); min_p filters after temperature, with
top-k and top-p. A greedy row takes the argmax of the processed logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from services.gpu_worker.engine.guided_mask import GuidedMasks
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.tokenizer import EngineTokenizer


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
    def __init__(self, tokenizer: EngineTokenizer | None = None, eos_token_ids: frozenset[int] | None = None) -> None:
        self._seeds: dict[str, int] = {}  # unseeded requests: a random seed drawn once
        self._drawn: dict[str, int] = {}  # draws so far, when the caller passes no indices
        self._unseeded = random.Random()
        self._gens: dict[torch.device, torch.Generator] = {}
        self.guides = GuidedMasks(tokenizer, eos_token_ids)  # structured output (needs the tokenizer)

    def forget(self, seq_id: str) -> None:
        """The request finished: drop what the sampler kept for it."""
        self._seeds.pop(seq_id, None)
        self._drawn.pop(seq_id, None)
        self.guides.forget(seq_id)

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
        outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
    ) -> SampleResult:
        """`logits[i]` belongs to `seq_ids[i]` with `params[i]`; it draws that request's output token
        number `indices[i]` (default: one more than the sampler drew for it before). `outputs[i]` /
        `prompts[i]`: the sequence's tokens so far, which penalties and grammars need."""
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids) or len(seq_ids) != len(params):
            raise ValueError(f"sampler: logits {tuple(logits.shape)} for {len(seq_ids)} sequences / {len(params)} params")
        n, vocab = logits.shape
        if n == 0:
            return SampleResult([])
        logits = logits.float()
        raw = logits  # logprobs are of the model's own distribution
        if any(p.penalized or p.logit_bias or p.guided for p in params):
            logits = self._processed(logits.clone(), seq_ids, params, outputs or [[] for _ in params],
                                     prompts or [[] for _ in params])
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
            logprobs = torch.log_softmax(raw, dim=-1)
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


    def _processed(self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams],
                   outputs: list[list[int]], prompts: list[list[int]]) -> torch.Tensor:
        """Penalties, logit_bias and grammar masks, in place on `logits` (a copy), each only on its rows."""
        device, vocab = logits.device, logits.shape[1]
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            index = torch.tensor(penalized, device=device)
            logits[index] = _penalized(logits[index], [params[i] for i in penalized],
                                       [outputs[i] for i in penalized], [prompts[i] for i in penalized])
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
        if biased:
            rows, cols, vals = zip(*biased)
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                              torch.tensor(vals, device=device, dtype=logits.dtype), accumulate=True)
        guided = [i for i, p in enumerate(params) if p.guided is not None]
        self.guides.apply(logits, guided, seq_ids, params, outputs)
        return logits


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in each row's list (ids >= vocab ignored)."""
    width = max((len(x) for x in ids), default=0)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    if width:
        padded = torch.full((len(ids), width), vocab, dtype=torch.long)
        for r, x in enumerate(ids):
            if x:
                padded[r, :len(x)] = torch.tensor(x, dtype=torch.long).clamp_(max=vocab)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _penalized(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
               prompts: list[list[int]]) -> torch.Tensor:
    """vLLM's order and definitions: repetition (HF's: a seen token's logit divided by the penalty when
    positive, multiplied when negative; prompt and output), then frequency (x count) and presence
    (once) subtracted for output tokens."""
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]
    out_counts = _counts(outputs, vocab, device)
    rep = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=dtype)[:, None]
    if bool((rep != 1).any()):
        seen = (out_counts > 0) | (_counts(prompts, vocab, device) > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device, dtype=dtype)[:, None]
    return logits - freq * out_counts - pres * (out_counts > 0).to(dtype)


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masks (-inf outside), for the random rows."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
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
