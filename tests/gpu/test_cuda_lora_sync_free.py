"""CaraServe's sync-free CPU LoRA invocation on CUDA (§4.2, Fig. 8; needs a GPU).

Invoking the helpers must not synchronize: the rows go device-to-host by an async copy and
the signal is a copy queued behind it, so under torch's sync debug mode "error" the sync-free
submit passes and the native one (a blocking copy, then the signal) raises. The deltas are
the adapter's x·A·B either way, and a cold adapter's prefill on CUDA with helpers is PEFT's.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ALL = ["q", "k", "v", "o", "gate", "up", "down"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    root = tmp_path_factory.mktemp("sync-free")
    base = make_model(root / "base", layers=2, hidden=64, heads=4, kv_heads=2, seed=5)
    return base, {f"a{i}": make_lora(root / f"a{i}", base, rank=r, targets=ALL, seed=i)
                  for i, r in enumerate([8, 16])}


def helpers_for(base: Path, sync_free: bool):
    from services.gpu_worker.engine.cpu_lora_helpers import CpuLoRAHelpers
    from services.gpu_worker.engine.model_config import load_model_config

    cfg = load_model_config(base)
    helpers = CpuLoRAHelpers(cfg, str(base), None, range(cfg.num_layers), 2, 256, sync_free=sync_free)
    helpers.wait_ready()
    return cfg, helpers


@pytest.mark.parametrize("sync_free", [True, False])
def test_invocation_does_not_synchronize_and_computes_x_a_b(assets, sync_free: bool) -> None:
    from services.gpu_worker.engine.cpu_lora_helpers import Segment
    from services.gpu_worker.engine.lora import load_adapter
    from services.gpu_worker.engine.lora_shared import share

    base, adapters = assets
    cfg, helpers = helpers_for(base, sync_free)
    try:
        for name, path in adapters.items():  # the worker's shared host copies, announced at registration
            helpers.register(name, share(load_adapter(path, name, cfg, range(cfg.num_layers)))[1])
        n = 96
        x = torch.randn(n, cfg.hidden_size, device="cuda:0")
        x = x * 2 + 1  # a kernel still queued when the invocation is issued
        segs = [Segment("a0", 8, 0, 40), Segment("a1", 16, 40, n - 40)]
        helpers.wait(helpers.submit(0, 0, x[:1], [Segment("a1", 16, 0, 1)]))  # warm, outside the checked call
        torch.cuda.set_sync_debug_mode("error")
        try:
            if sync_free:
                ticket = helpers.submit(1, 0, x, segs)
            else:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    helpers.submit(1, 0, x, segs)
                return
        finally:
            torch.cuda.set_sync_debug_mode(0)
        y = helpers.wait(ticket).clone()
        xc = x.cpu()
        for seg in segs:
            ad = load_adapter(adapters[seg.adapter], seg.adapter, cfg, range(cfg.num_layers))
            rows = xc[seg.row:seg.row + seg.count]
            want = torch.cat([(rows @ ad.weights[(1, t)][0].t()) @ ad.weights[(1, t)][1].t()
                              for t in ("q_proj", "k_proj", "v_proj")], dim=1)
            assert torch.allclose(y[seg.row:seg.row + seg.count], want, atol=1e-5)
    finally:
        helpers.close()


def test_cold_prefill_on_cuda_with_helpers_matches_peft(assets) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    base, adapters = assets
    eng = LLMEngine(EngineConfig(str(base), device="cuda:0", pool_bytes=256 << 20, max_prefill_chunk=32,
                                 max_num_batched_tokens=256, cpu_lora_assist=True, cpu_lora_processes=2,
                                 lora_load_bandwidth=1e9))
    try:
        for name, path in adapters.items():
            eng.add_lora(name, path)
        eng.cold.start_helpers()
        eng.runner.cpu_lora.wait_ready()
        gate = threading.Event()
        eng.cold.loads._sleep = lambda _s: gate.wait(60)  # noqa: SLF001 - the load lands when the test says
        ids = torch.randint(1, 1000, (70,), generator=torch.Generator().manual_seed(2)).tolist()
        eng.add_request("r", ids, SamplingParams(max_tokens=6, temperature=0), adapter="a1")
        out: list[int] = []
        for _ in range(3):  # chunks 1..3 of the prefill on the helpers, the load held back
            for d in eng.step():
                out.extend(d.new_token_ids)
        assert eng.cold.cpu_chunks >= 2
        gate.set()
        for _ in range(2000):
            if not eng.has_unfinished:
                break
            for d in eng.step():
                out.extend(d.new_token_ids)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          adapters["a1"]).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids + out[:-1]])).logits[0]
        assert ref[len(ids) - 1:].argmax(-1).tolist() == out
        assert eng.cold.fallbacks == 0
    finally:
        eng.cold.close()
