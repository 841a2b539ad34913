"""Sampling parameters validation and the torch sampler."""
from __future__ import annotations

import math

import pytest
import torch

from services.gpu_worker.engine.sampler import Sampler
from services.gpu_worker.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_params_are_refused_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(**kwargs)


def test_params_normalise() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.top_k == 0 and p.greedy
    assert p.max_stop_len == 3


def test_greedy_and_logprobs_of_the_chosen_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 5.0]])
    out = Sampler().sample(logits, ["a", "b"], [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)])
    assert out.token_ids == [1, 3]
    expected = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprobs[0], expected[1].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2]
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_top_k_and_top_p_restrict_the_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    top3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler()
    seen_k = {sampler.sample(logits, [f"k{i}"], [SamplingParams(temperature=5.0, top_k=3)]).token_ids[0] for i in range(200)}
    assert seen_k <= top3 and len(seen_k) > 1
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    seen_p = {sampler.sample(logits, [f"p{i}"], [SamplingParams(temperature=1.0, top_p=0.5)]).token_ids[0] for i in range(300)}
    assert seen_p <= nucleus and len(seen_p) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    counts = [0, 0, 0]
    for i in range(2000):
        counts[sampler.sample(logits, [f"s{i}"], [SamplingParams(temperature=1.0)]).token_ids[0]] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.03


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(6, 100) for _ in range(8)]
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(row: int, batch: int) -> list[int]:
        sampler = Sampler()
        ids = [f"other{j}" for j in range(batch)]
        ids[row] = "me"
        params = [SamplingParams(temperature=0.8) for _ in range(batch)]
        params[row] = seeded
        tokens = []
        for logits in steps:
            rows = logits[:batch].clone()
            rows[row] = logits[5]
            tokens.append(sampler.sample(rows, ids, params).token_ids[row])
        return tokens

    alone = run(0, 1)
    assert run(3, 6) == alone and run(1, 2) == alone
    assert len(set(alone)) > 1
    other_seed = Sampler()
    diff = [other_seed.sample(s[5:6], ["me"], [SamplingParams(temperature=1.0, seed=99)]).token_ids[0] for s in steps]
    assert diff != alone


# --- the controls that change the distribution: vLLM's definitions, vectorized over the batch ----
@pytest.mark.parametrize(("kwargs", "name"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"guided": ("bnf", "x")}, "guided"),
])
def test_bad_sampling_controls_are_refused_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(SamplingParamsError, match=name):
        SamplingParams(**kwargs)


def test_logit_bias_bans_and_forces_tokens_per_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [0.0, 3.0, 1.0, -1.0], [0.0, 3.0, 1.0, -1.0]])
    params = [SamplingParams(temperature=0, logit_bias={1: -100}), SamplingParams(temperature=0, logit_bias={3: 100}),
              SamplingParams(temperature=0, logprobs=0)]
    out = Sampler().sample(logits, ["a", "b", "c"], params)
    assert out.token_ids == [2, 3, 1]  # banned, forced, untouched
    banned = {Sampler().sample(logits[:1], [f"r{i}"], [SamplingParams(temperature=2.0, logit_bias={1: -100})]).token_ids[0]
              for i in range(100)}
    assert 1 not in banned and len(banned) > 1


def test_penalties_follow_vllms_definitions() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    sampler = Sampler()
    # frequency: 2.0 - 0.1 x 2 occurrences < 1.9; presence alike (once)
    assert sampler.sample(logits, ["f"], [SamplingParams(temperature=0, frequency_penalty=0.1)], outputs=[[0, 0]]).token_ids == [1]
    assert sampler.sample(logits, ["f1"], [SamplingParams(temperature=0, frequency_penalty=0.1)], outputs=[[0]]).token_ids == [0]
    assert sampler.sample(logits, ["p"], [SamplingParams(temperature=0, presence_penalty=0.2)], outputs=[[0, 0, 0]]).token_ids == [1]
    # repetition: a positive logit seen in the prompt is divided (2.0 / 1.2 < 1.9); negative ones multiplied
    assert sampler.sample(logits, ["r"], [SamplingParams(temperature=0, repetition_penalty=1.2)], outputs=[[]],
                          prompts=[[0]]).token_ids == [1]
    # a row without penalties in the same batch is untouched
    both = sampler.sample(torch.cat([logits, logits]), ["x", "y"],
                          [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)],
                          outputs=[[0], [0]])
    assert both.token_ids == [1, 0]


def test_min_p_drops_the_unlikely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {Sampler().sample(logits, [f"m{i}"], [SamplingParams(temperature=1.0, min_p=0.25)]).token_ids[0]
            for i in range(300)}
    assert seen == {0, 1, 2}  # 0.05 < 0.25 x 0.5
