"""The CPU decode step's lean pieces, each held to what it replaced: the row-count dispatch of
`gpu_ext.linear`, the 4-op rope, the fused fp32 RMSNorm, the per-step layer rows of the attention
layout, and the fp32 GGUF that `tidal bench engine` hands llama.cpp (same weights, same metadata).
End to end, greedy tokens against transformers are held by test_model_vs_transformers.py and,
on the real SmolLM2, test_gguf_import.py."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_ext import linear as lin
from services.gpu_worker.engine.attention_metadata import build_step_layout
from services.gpu_worker.engine.batch import ScheduledChunk
from services.gpu_worker.engine.models.llama import apply_rope, apply_rope_full, rms_norm
from tidal.bench.engine_gguf import write_f32_gguf


@pytest.mark.parametrize("rows", [1, 3, lin.ONEDNN_MIN_ROWS, 40])
def test_linear_matches_f_linear_on_either_side_of_the_row_threshold(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    torch.testing.assert_close(lin.linear(x, lin.pack_weight(w), b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_weights_stay_plain_unless_packing_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(32, 16).t()  # not contiguous: made so once, at load
    plain = lin.pack_weight(w)
    assert not plain.is_mkldnn and plain.is_contiguous() and torch.equal(plain, w)
    monkeypatch.setenv("TIDAL_PACK_WEIGHTS", "1")
    if not lin.onednn_usable("cpu", torch.float32):
        pytest.skip("oneDNN does not run fp32 linear here")
    packed = lin.pack_weight(w)
    assert packed.is_mkldnn
    x = torch.randn(2, 32)
    torch.testing.assert_close(lin.linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_rope_full_is_bitwise_the_half_split_rope() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, 64, generator=gen)[:, :9]  # a strided view, as q|k out of qkv
    cos, sin = torch.randn(5, 1, 32, generator=gen), torch.randn(5, 1, 32, generator=gen)
    got = apply_rope_full(x, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
    assert torch.equal(got, apply_rope(x, cos, sin))


def test_fused_rms_norm_equals_transformers_op_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.gpu_worker.engine.models import llama

    x, w = torch.randn(4, 576) * 3, torch.randn(576)
    fused = rms_norm(x, w, 1e-5)
    monkeypatch.setattr(llama, "_FUSED_RMS_NORM", False)
    torch.testing.assert_close(fused, rms_norm(x, w, 1e-5), atol=1e-6, rtol=1e-6)


def _chunk(seq: str, start: int, n: int, tables: dict[int, list[int]]) -> ScheduledChunk:
    return ScheduledChunk(seq, list(range(n)), start, tables)


def test_layout_rows_per_layer_and_the_all_decode_flag() -> None:
    tables = {0: [3, 4], 1: [7, 8]}
    decode = [_chunk("a", 20, 1, tables), _chunk("b", 5, 1, {0: [1], 1: [2]})]
    lay = build_step_layout(decode, [0, 1], 16, torch.device("cpu"), split_decode=False)
    assert lay.all_decode
    assert lay.slots is not None and all(torch.equal(lay.slots_of(r), lay.slots[r]) for r in range(2))
    g = lay.decode_groups[0]
    assert all(torch.equal(g.table_of(r), g.tables[r]) for r in range(2))
    assert lay.slots_of(1).tolist() == [8 * 16 + 4, 2 * 16 + 5]
    mixed = [_chunk("a", 20, 1, tables), _chunk("c", 0, 3, {0: [5], 1: [6]})]
    assert not build_step_layout(mixed, [0, 1], 16, torch.device("cpu"), split_decode=False).all_decode
    # split into groups (the torch path): no single call makes every row
    wide = [_chunk("a", 200, 1, {0: list(range(13)), 1: list(range(13))}), _chunk("b", 5, 1, {0: [1], 1: [2]})]
    assert not build_step_layout(wide, [0, 1], 16, torch.device("cpu"), split_decode=True).all_decode


def test_f32_gguf_holds_the_dequantized_weights_and_every_field(tmp_path: Path) -> None:
    src = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_block_count(1)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_token_list(["<s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.linspace(-1, 1, 3 * 32, dtype=np.float32).reshape(3, 32))
    q = gguf.quants.quantize(np.linspace(-2, 2, 4 * 64, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = write_f32_gguf(src, tmp_path / "f32.gguf")
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert after.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert after.fields["llama.block_count"].contents() == 1
    for t0, t1 in zip(before.tensors, after.tensors):
        assert t1.name == t0.name and t1.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t1.data), gguf.quants.dequantize(t0.data, t0.tensor_type))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("window", [None, 5])
def test_all_decode_layout_equals_the_general_one(window: int | None) -> None:
    """The all-decode shortcut (one pass of Python ints) builds the general path's tensors."""
    from services.gpu_worker.engine import attention_metadata as am

    chunks = [_chunk("a", 37, 1, {0: [9, 4, 6, 2], 2: [1, 3, 5]}), _chunk("b", 3, 1, {0: [8], 2: [7]}),
              _chunk("c", 16, 1, {0: [10, 11], 2: [12, 13, 14]})]
    cpu = torch.device("cpu")
    fast = am.build_step_layout(chunks, [0, 2], 16, cpu, window, split_decode=False)
    slow = am._general_layout(chunks, [0, 2], 16, cpu, window, 0, False)
    assert fast.all_decode and slow.all_decode and fast.layer_rows == slow.layer_rows and not fast.prefills
    assert torch.equal(fast.positions, slow.positions) and torch.equal(fast.slots, slow.slots)
    (f,), (s,) = fast.decode_groups, slow.decode_groups
    assert f.rows == s.rows == slice(0, 3)
    for name in ("tables", "key_mask", "ctx_lens"):
        assert torch.equal(getattr(f, name), getattr(s, name)), name
    with pytest.raises(ValueError, match="needs 3 for 37 tokens"):
        am.build_step_layout([_chunk("a", 36, 1, {0: [1, 2]})], [0], 16, cpu, split_decode=False)
