"""gpu_ext's few-row C++ projections (gpu_ext/cpu_matvec.py) against torch on the same tensors:
every row count 1..MAX_ROWS, weight row counts that do and do not fill the 16-row tasks, inner
sizes with and without a vector tail and a scalar tail, bias and residual on and off, 1 and 2
threads; the thread pool (gpu_ext/cpu_pool.py): the same bits at any thread count, from two
Python threads at once, and in a forked child; and that a fp32 CPU decode step of the model goes
through them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_ext.cpu_matvec import MAX_ROWS
from gpu_ext.linear import linear, small_ops

OPS = small_ops("cpu", torch.float32)
pytestmark = pytest.mark.skipif(OPS is None, reason="the CPU kernel library does not build here")

SHAPES = [(1, 8), (5, 13), (33, 576), (576, 1536), (4099, 64), (17, 44)]  # (N, K)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", SHAPES)
def test_small_linear_matches_f_linear(rows, n, k, threads):
    gen = torch.Generator().manual_seed(n * 7 + k + rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b, res = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    tol = dict(atol=1e-4 * k**0.5, rtol=1e-4)
    torch.testing.assert_close(OPS.small_linear(x, w, None, None), F.linear(x, w), **tol)
    torch.testing.assert_close(OPS.small_linear(x, w, b, None), F.linear(x, w, b), **tol)
    torch.testing.assert_close(OPS.small_linear(x, w, b, res), res + F.linear(x, w, b), **tol)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), **tol)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("n,k", SHAPES[1:])
def test_rms_and_silu_forms_match_torch(rows, n, k, threads):
    gen = torch.Generator().manual_seed(n + k * 3 + rows)
    x, norm_w, w = torch.randn(rows, k, generator=gen) * 3, torch.rand(k, generator=gen) + 0.5, torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    tol = dict(atol=1e-4 * k**0.5, rtol=1e-4)
    want = F.linear(torch.rms_norm(x, (k,), norm_w, 1e-5), w, b)
    torch.testing.assert_close(OPS.rms_small_linear(x, norm_w, 1e-5, w, b), want, **tol)
    gate_up, res = torch.randn(rows, 2 * k, generator=gen), torch.randn(rows, n, generator=gen)
    act = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    torch.testing.assert_close(OPS.silu_small_linear(gate_up, w, res), res + F.linear(act, w), **tol)


def test_threads_give_the_same_bits():
    """Each output row is summed by one thread in one order: 1, 2 and 3 threads agree exactly."""
    gen = torch.Generator().manual_seed(11)
    x, w, res = torch.randn(2, 576, generator=gen), torch.randn(3072 + 5, 576, generator=gen), None
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3, 2):
            torch.set_num_threads(t)
            outs.append(OPS.small_linear(x, w, None, res))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_calls_from_two_threads_at_once():
    """Two Python threads calling at once (one runs on the pool, the other alone) both get right answers."""
    import threading

    gen = torch.Generator().manual_seed(12)
    w = torch.randn(4096, 256, generator=gen)
    xs = [torch.randn(1, 256, generator=gen) for _ in range(2)]
    wants = [F.linear(x, w) for x in xs]
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            for _ in range(50):
                torch.testing.assert_close(OPS.small_linear(xs[i], w, None, None), wants[i], atol=1e-3, rtol=1e-4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runners = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for r in runners:
            r.start()
        for r in runners:
            r.join()
    finally:
        torch.set_num_threads(before)
    assert not errors, errors


def test_forked_child_runs_the_tasks_itself():
    """After fork() the pool's workers are gone: the child's call still computes every row."""
    import multiprocessing

    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(1, 64, generator=gen), torch.randn(999, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        OPS.small_linear(x, w, None, None)  # the parent's workers are started
        with multiprocessing.get_context("fork").Pool(1) as pool:
            got = pool.apply_async(_child_small_linear, (x, w)).get(timeout=120)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)


def _child_small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(2)
    return OPS.small_linear(x, w, None, None)


@pytest.mark.parametrize("rows", [1, 3])
def test_layer_halves_equal_the_separate_calls(rows):
    """rms_qkv_rope is rms_small_linear then rope_qk (q, k, v as views); rms_mlp is small_linear,
    rms_small_linear and silu_small_linear in turn: the same bits."""
    heads, kv_heads, dim, hidden, inter = 9, 3, 64, 576, 1536
    gen = torch.Generator().manual_seed(rows)
    x, norm_w = torch.randn(rows, hidden, generator=gen), torch.rand(hidden, generator=gen) + 0.5
    wqkv, bqkv = torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen), torch.randn((heads + 2 * kv_heads) * dim, generator=gen)
    ang = torch.rand(rows, 1, dim // 2, generator=gen) * 50
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    q, k, v = OPS.rms_qkv_rope(x, norm_w, 1e-5, wqkv, bqkv, cos, sin, heads, kv_heads, dim)
    qkv = OPS.rms_small_linear(x, norm_w, 1e-5, wqkv, bqkv)
    qk = OPS.rope_qk(qkv, cos, sin, heads + kv_heads, dim)
    assert q.shape == (rows, heads, dim) and k.shape == (rows, kv_heads, dim) and v.shape == (rows, kv_heads, dim)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim))
    attn, wo = torch.randn(rows, heads * dim, generator=gen), torch.randn(hidden, heads * dim, generator=gen) * 0.05
    w13, w2 = torch.randn(2 * inter, hidden, generator=gen) * 0.05, torch.randn(hidden, inter, generator=gen) * 0.05
    h = OPS.small_linear(attn, wo, None, x)
    want = OPS.silu_small_linear(OPS.rms_small_linear(h, norm_w, 1e-5, w13, None), w2, h)
    assert torch.isfinite(want).all()
    assert torch.equal(OPS.rms_mlp(attn, wo, x, norm_w, 1e-5, w13, w2), want)
    with pytest.raises(RuntimeError, match="heads"):
        OPS.rms_qkv_rope(x, norm_w, 1e-5, wqkv, bqkv, cos, sin, heads + 1, kv_heads, dim)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 8), (2, 1, 6)])
def test_rope_qk_matches_apply_rope_full(heads, kv_heads, dim):
    from services.gpu_worker.engine.models.llama import apply_rope_full

    gen = torch.Generator().manual_seed(heads + dim)
    t = 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
    ang = torch.rand(t, 1, dim // 2, generator=gen) * 50
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((-ang.sin(), ang.sin()), -1)
    want = apply_rope_full(qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim), cos, sin)
    torch.testing.assert_close(OPS.rope_qk(qkv, cos, sin, heads + kv_heads, dim), want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise():
    with pytest.raises(RuntimeError, match="x must be"):
        OPS.small_linear(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8), None, None)
    with pytest.raises(RuntimeError, match="w must be"):
        OPS.small_linear(torch.randn(1, 8), torch.randn(4, 9), None, None)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        OPS.small_linear(torch.randn(1, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), None, None)
    with pytest.raises(RuntimeError, match="bias/residual"):
        OPS.small_linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5), None)


def test_decode_step_runs_the_fused_projections(tmp_path, monkeypatch):
    """A decode step of a generated fp32 model calls the fused ops (not F.linear), and its logits
    equal those of the same model with the fused path off."""
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from services.gpu_worker.engine.loader import CheckpointReader
    from services.gpu_worker.engine.model_config import load_model_config
    from services.gpu_worker.engine.models.llama import LayerWeights, LlamaModel

    make_model(tmp_path, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, seed=3)
    cfg = load_model_config(tmp_path, "float32")
    reader = CheckpointReader(tmp_path, cfg)
    model = LlamaModel(cfg)
    assert model.cpu_ops is OPS
    model.layers = {i: LayerWeights.from_hf(reader.read_layer(i)) for i in range(cfg.num_layers)}
    model.embed, model.final_norm = reader.read_embedding(), reader.read_final_norm()
    model.lm_head = model.embed if cfg.tie_word_embeddings else reader.read_lm_head()

    def plain_attention(layer, q, k, v):  # one token attending to itself: softmax is 1
        return v.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)

    hidden = model.embed_tokens(torch.tensor([5, 9]))
    calls: list[str] = []
    monkeypatch.setattr(model, "cpu_ops", _Spy(OPS, calls))
    fast = model.compute_logits(model.run_layers(0, cfg.num_layers, hidden, torch.tensor([0, 0]), plain_attention))
    assert calls == ["rms_qkv_rope", "rms_mlp"] * cfg.num_layers + ["rms_small_linear"]  # 2 per layer; the head
    monkeypatch.setattr(model, "cpu_ops", None)
    plain = model.compute_logits(model.run_layers(0, cfg.num_layers, hidden, torch.tensor([0, 0]), plain_attention))
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)


class _Spy:
    """Records which op of the namespace the model calls."""

    def __init__(self, ops, calls: list[str]) -> None:
        self._ops, self._calls = ops, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._ops, name)


def test_huge_pages_copies_into_one_aligned_block():
    from gpu_ext.linear import huge_pages
    from services.gpu_worker.engine.models.llama import LayerWeights

    gen = torch.Generator().manual_seed(1)
    src = [torch.randn(33, 17, generator=gen), torch.randn(5, generator=gen), torch.randn(64, 64, generator=gen).t()]
    out = huge_pages(src)
    assert out[0].data_ptr() % (2 << 20) == 0
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one allocation
    for a, b in zip(src, out):
        assert torch.equal(a, b) and b.is_contiguous() and a.data_ptr() != b.data_ptr()
    assert huge_pages([torch.ones(3, dtype=torch.float64)])[0].dtype == torch.float64  # other dtypes: as they are
    hf = {"input_layernorm.weight": torch.ones(8), "post_attention_layernorm.weight": torch.ones(8),
          **{f"self_attn.{p}_proj.weight": torch.randn(8, 8, generator=gen) for p in "qkvo"},
          **{f"mlp.{p}_proj.weight": torch.randn(12 if p != "down" else 8, 8 if p != "down" else 12, generator=gen)
             for p in ("gate", "up", "down")}}
    layer = LayerWeights.from_hf(hf)
    assert len({t.untyped_storage().data_ptr() for t in layer.tensors()}) == 1
    torch.testing.assert_close(layer.w2, hf["mlp.down_proj.weight"], rtol=0, atol=0)
