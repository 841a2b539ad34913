"""LLMEngine on CUDA (fp32) against transformers (and PEFT) on the same generated checkpoint on
the same device, and against the same engine on CPU.

A batch of prompts of mixed lengths (a one-token prompt, block boundaries) decodes greedily in
one engine: every sequence's tokens must be transformers' greedy generation of that prompt
alone, the transformers' teacher-forced argmax at every position, and the CPU engine's tokens;
the logprob of each chosen token must match transformers' within fp32 noise. Then the engine
paths a GPU worker uses besides the plain step: chunked prefill, seeded sampling (a request's
tokens do not depend on its batch), a request detached with its KV and attached again, layers
dropped and restored, and a mixed-adapter LoRA batch (adapters copied to the device beside
the steps) against PEFT, both batched LoRA paths.

`TIDAL_GPU_TESTS_DEVICE=cpu` runs the same checks on CPU (a dry run of the tests themselves).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
from services.gpu_worker.engine.sampling_params import SamplingParams

DEVICE = os.environ.get("TIDAL_GPU_TESTS_DEVICE", "cuda:0")
pytestmark = [
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

PROMPT_LENS = [1, 5, 16, 17, 40]  # a one-token prompt and block boundaries (block_size 4 and 16)
NEW = 24
LOGPROB_TOL = 1e-3  # fp32 on both sides; different kernels and reduction orders

VARIANTS = {
    "llama": dict(arch="llama", layers=3, hidden=64, heads=4, kv_heads=2),
    "qwen2-tied-bias": dict(arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2),
    "mistral-window": dict(arch="mistral", layers=2, hidden=64, heads=4, kv_heads=2, sliding_window=24),
}


@pytest.fixture(scope="module", autouse=True)
def fp32_matmuls() -> Iterator[None]:
    """Exact fp32 matmuls (no TF32) on both sides of every comparison."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, make_model(tmp_path_factory.mktemp(name), seed=3, **VARIANTS[name])


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def engine(model_dir: Path, device: str = DEVICE, **overrides) -> LLMEngine:
    # pool_bytes given: on CUDA the default is 90% of free HBM, all of it KV region
    config = dict(pool_bytes=64 << 20, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, device=device)
    return LLMEngine(EngineConfig(str(model_dir), **(config | overrides)))


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def hf_model(model_dir: Path, adapter: Path | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.to(DEVICE).eval()


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced log-softmax rows predicting each output token: [len(output), vocab] (host)."""
    tokens = torch.tensor([prompt + output[:-1]], device=DEVICE)
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def assert_matches_oracle(model, prompt: list[int], result, what: str) -> torch.Tensor:
    """The engine's greedy tokens are the oracle's argmax at every position, their logprobs its
    log-softmax there; returns the oracle's rows."""
    out = result.token_ids
    assert len(out) == NEW, f"{what}: {len(out)} tokens"
    ref = hf_logprobs(model, prompt, out)
    assert ref.argmax(-1).tolist() == out, f"{what}: greedy tokens differ from the oracle's argmax"
    picked = ref.gather(1, torch.tensor(out)[:, None]).squeeze(1)
    diff = (torch.tensor(result.logprobs) - picked).abs().max().item()
    assert diff <= LOGPROB_TOL, f"{what}: max |logprob diff| {diff:.2e}"
    return ref


def test_greedy_batch_equals_transformers_greedy_generation(variant):
    name, model_dir = variant
    e = engine(model_dir, block_size=4)  # small blocks: many per sequence, decode groups padded
    assert e.runner.kv_cache.blocks.device == torch.device(DEVICE)
    ps = prompts(e.runner.cfg.vocab_size)
    results = e.generate(ps, greedy())  # one batch: prefill together, decode together
    hf = hf_model(model_dir)
    for i, (prompt, result) in enumerate(zip(ps, results)):
        assert_matches_oracle(hf, prompt, result, f"{name}/seq{i}")
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        expected = gen[0, len(prompt):].tolist()
        assert expected and result.token_ids[:len(expected)] == expected, f"{name}/seq{i}: transformers' generate"
        if len(expected) < NEW:  # transformers stopped at an EOS the engine was told to ignore
            assert expected[-1] in e.eos_token_ids
    assert len({tuple(r.token_ids[:8]) for r in results}) == len(results), "degenerate model: same outputs"
    assert e.blocks.num_used_blocks == 0


def test_cuda_engine_equals_cpu_engine(variant, monkeypatch):
    name, model_dir = variant
    ps = prompts(1024, seed=1)
    ours = engine(model_dir).generate(ps, greedy())
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")  # the torch path: no JIT build of the CPU kernel here
    cpu = engine(model_dir, device="cpu").generate(ps, greedy())
    for i, (a, b) in enumerate(zip(ours, cpu)):
        assert a.token_ids == b.token_ids, f"{name}/seq{i}: {DEVICE} and CPU tokens differ"
        diff = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        assert diff <= LOGPROB_TOL, f"{name}/seq{i}: max |logprob diff| {diff:.2e}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), seed=3, **VARIANTS["llama"])


def test_chunked_prefill_and_seeded_sampling_on_cuda(llama):
    ps = prompts(1024, seed=2)
    whole = engine(llama).generate(ps, greedy())
    chunked = engine(llama, max_prefill_chunk=7).generate(ps, greedy())
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=NEW, ignore_eos=True)
    e = engine(llama)
    alone = e.generate([ps[3]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NEW, ignore_eos=True) for i in range(4)]
    batched = e.generate([ps[0], ps[1], ps[3], ps[4], ps[2]], [others[0], others[1], seeded, others[2], others[3]])
    assert batched[2].token_ids == alone, "a seeded request's tokens depend on its batch"
    assert alone != whole[3].token_ids[:NEW], "temperature 0.9 gave the greedy tokens: sampling not exercised"


def test_detach_with_kv_then_attach_and_drop_restore_on_cuda(llama):
    ps = prompts(1024, seed=3)
    expected = engine(llama).generate([ps[4]], greedy())[0].token_ids
    e = engine(llama)
    e.add_request("r", ps[4], greedy())
    got: list[int] = []
    while len(got) < 5:
        for o in e.step():
            got += o.new_token_ids
    d = e.detach("r", keep_kv=True)
    assert d is not None and d.num_computed_tokens > 0
    views = e.kv_views("r", 0, 2)  # what the data plane would send: views of the CUDA cache, no copy
    assert views and all(v.device == torch.device(DEVICE) for v in views)
    e.attach("r", d.prompt_token_ids, d.params, output_token_ids=d.output_token_ids,
             num_computed_tokens=d.num_computed_tokens, priority=d.priority)
    while e.has_unfinished:
        for o in e.step():
            got += o.new_token_ids
    assert got == expected, "detached and attached again (KV kept on the device): other tokens"

    freed = e.drop_layers(1, 3)
    assert freed > 0 and e.runner.resident_layers() == [0]
    e.restore_layers(1, 3)
    assert e.runner.resident_layers() == [0, 1, 2]
    assert all(w.wqkv.device == torch.device(DEVICE) for w in e.runner.model.layers.values())
    assert e.generate([ps[4]], greedy())[0].token_ids == expected, "after a drop and restore: other tokens"


@pytest.mark.parametrize("mode", ["segmented", "padded"])
def test_mixed_adapter_batch_matches_peft_on_cuda(tmp_path_factory, mode):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp(f"lora-{mode}")
    base = make_model(root / "base", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, seed=5)
    adapters = {
        "small": make_lora(root / "small", base, rank=4, targets=["q", "v"], seed=1),
        "big": make_lora(root / "big", base, rank=16, targets=["q", "k", "v", "o", "gate", "up", "down"], seed=2),
    }
    e = engine(base, lora_mode=mode)
    for name, path in adapters.items():
        e.add_lora(name, path)
    batch = [(9, "small"), (23, None), (4, "big"), (31, "small"), (1, "big"), (17, None)]
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, 1024, (n,), generator=g).tolist() for n, _ in batch]
    names = [a for _, a in batch]
    results = e.generate(ps, greedy(), adapters=names)
    resident = e.runner.lora.resident
    assert set(resident) == {"small", "big"}
    assert all(a.device == torch.device(DEVICE) for adapter, _ in resident.values() for a, _ in adapter.weights.values())
    oracles = {None: hf_model(base), **{n: hf_model(base, p) for n, p in adapters.items()}}
    effect = 0.0
    for i, (prompt, name, result) in enumerate(zip(ps, names, results)):
        ref = assert_matches_oracle(oracles[name], prompt, result, f"s{i} ({name})")
        if name is not None:
            plain = hf_logprobs(oracles[None], prompt, result.token_ids)
            effect = max(effect, (ref - plain).abs().max().item())
    assert effect > 0.1, "adapters barely change the outputs: the comparison proves nothing"
