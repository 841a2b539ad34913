"""The Llama family (Llama 2/3, Qwen2, Mistral) as plain tensors and functions.

gpt-fast style: no nn.Module tree, weights are fused tensors per layer (q|k|v in one
matrix, gate|up in one), and the forward is written out. It is decomposed for Tidal:

- any contiguous layer range runs on given hidden states (`run_layers`); the embedding
  lives on the first stage, norm + lm_head on the last;
- each layer is split into `pre_attention` (norm, qkv, rope) → attention → `post_attention`
  (o_proj, residual, MLP), and the attention is an object handed in from outside, so a
  layer's attention can run wherever that layer's KV lives (remote attention).

All token tensors are flat over the step's tokens: hidden [T, H], q [T, heads, head_dim].

On CUDA the elementwise stages run as gpu_ext's fused Triton kernels (`fused`: RMSNorm with
the residual add, rotary embedding of q and k by position, SiLU * up), one kernel each instead
of torch's ~40 small ones per layer, rounding where torch rounds. On fp32 CPU a step of at most
`MAX_ROWS` tokens without LoRA (single-stream decode) runs each layer's projections as gpu_ext's
fused C++ calls (`cpu_ops`, gpu_ext/cpu_matvec.py): norm + qkv + the rotary embedding of q and k
(`rms_qkv_rope`), and o_proj + residual + norm + gate|up + SiLU-gate + down + residual (`rms_mlp`):
2 calls where torch took ~22 ops. Where every token of the step decodes on the C++ attention kernel
(the runner checks: no LoRA, no remote attention), `decode_layers` runs the whole layer range, KV
write and attention included, as one C++ call (gpu_ext/cpu_decode.py) with the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_ext.cpu_matvec import MAX_ROWS
from gpu_ext.linear import huge_pages, linear, pack_weight, packing_enabled, small_ops, weight_nbytes

from ..model_config import ModelConfig

_FUSED_RMS_NORM = hasattr(torch, "rms_norm")


class LayerAttention(Protocol):
    """Attention of one layer over the step's tokens: q [T, heads, d], k/v [T, kv_heads, d]
    (new tokens only) → [T, heads, d]. It stores k/v in its own KV cache."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class DecodeKV:
    """What `decode_layers` needs of the KV cache for a step (PagedAttention.decode_kv): the caches
    [blocks, block_size, kv_heads, d], per layer row the tokens' slots [L, T] and block tables
    [L, T, NB], each token's context length [T], the softmax scale and the sliding window (0: none)."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    ctx_lens: torch.Tensor
    scale: float
    window: int


class LoRAHook(Protocol):
    """Adds the step's per-token LoRA deltas in place: out += scale * x @ A^T @ B^T.
    `start` comes first, before the base matmul of the same input, so deltas computed
    elsewhere (CPU helpers) overlap with it; `add` then follows once per target."""

    def start(self, layer: int, targets: tuple[str, ...], x: torch.Tensor) -> None: ...

    def add(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    wqkv: torch.Tensor  # [q + 2 kv, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    post_norm: torch.Tensor
    w13: torch.Tensor  # gate rows then up rows: [2 intermediate, hidden]
    w2: torch.Tensor

    @classmethod
    def from_hf(cls, t: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> LayerWeights:
        """Fuse HF tensors of one layer; projections packed for the device's fastest matmul."""
        bias = None
        if "self_attn.q_proj.bias" in t:
            bias = torch.cat([t[f"self_attn.{p}_proj.bias"] for p in "qkv"]).to(device)
        return cls(
            input_norm=t["input_layernorm.weight"].to(device),
            wqkv=pack_weight(torch.cat([t[f"self_attn.{p}_proj.weight"] for p in "qkv"]).to(device)),
            bqkv=bias,
            wo=pack_weight(t["self_attn.o_proj.weight"].to(device)),
            post_norm=t["post_attention_layernorm.weight"].to(device),
            w13=pack_weight(torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]).to(device)),
            w2=pack_weight(t["mlp.down_proj.weight"].to(device)),
        ).on_huge_pages()

    def on_huge_pages(self) -> LayerWeights:
        """This layer's fp32 CPU tensors in one huge-page block (gpu_ext.linear.huge_pages), else itself."""
        names = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        moved = huge_pages([getattr(self, n) for n in names])
        return LayerWeights(**{f.name: None for f in fields(self)} | dict(zip(names, moved)))

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if (t := getattr(self, f.name)) is not None]

    @property
    def nbytes(self) -> int:
        return sum(weight_nbytes(t) for t in self.tensors())

    def to(self, device: torch.device | str) -> LayerWeights:
        moved = {f.name: (t.to(device) if (t := getattr(self, f.name)) is not None else None) for f in fields(self)}
        return LayerWeights(**moved)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and _FUSED_RMS_NORM:
        # One op instead of seven (a decode step runs 61 of them): the same math in fp32, where
        # transformers' op order only matters for the rounding to a 16-bit dtype.
        return torch.rms_norm(x, weight.shape, weight, eps)
    # Same op order as transformers' LlamaRMSNorm (normalise in fp32, scale in model dtype).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryTable:
    """cos/sin for every position up to the model's context, computed once in fp32."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        inv_freq = cfg.rope.inv_freq(cfg.head_dim)
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().to(device=device, dtype=cfg.dtype)
        self.sin = freqs.sin().to(device=device, dtype=cfg.dtype)
        # Full width for `apply_rope_full`: cos twice, sin with the first half negated.
        self.cos_full = torch.cat((self.cos, self.cos), dim=-1)
        self.sin_signed = torch.cat((-self.sin, self.sin), dim=-1)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions → cos, sin shaped [T, 1, head_dim/2] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def lookup_full(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions → `cos_full`, `sin_signed` rows shaped [T, 1, head_dim] (`apply_rope_full`)."""
        return self.cos_full[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Non-interleaved halves (HF "rotate_half" convention).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope_full(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in 4 ops instead of 8 (RotaryTable.lookup_full), rounding alike: the halves
    swapped (roll by head_dim/2) times the signed sin is (-x2 * sin, x1 * sin), and a - b == a + -b."""
    out = x * cos_full
    return out.add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed))


class LlamaModel:
    """Weights of a layer range plus (optionally) embedding and head; the forward pieces."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.layers: dict[int, LayerWeights] = {}
        self.embed: torch.Tensor | None = None  # first stage only
        self.final_norm: torch.Tensor | None = None  # last stage only
        self.lm_head: torch.Tensor | None = None
        self.rope = RotaryTable(cfg, self.device)
        self.fused = None  # gpu_ext.triton_fused on CUDA (imports Triton: CUDA paths only)
        self._lists: tuple | None = None  # `_decode_lists`' (range, layers, lists) of the last call
        # gpu_ext's fused few-row projections on fp32 CPU (None: not built, TIDAL_CPU_MATVEC=0, packed weights)
        self.cpu_ops = None if packing_enabled(self.device, cfg.dtype) else small_ops(self.device, cfg.dtype)
        if self.device.type == "cuda":
            from gpu_ext import triton_fused

            self.fused = triton_fused

    # --- pieces -------------------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            raise RuntimeError("this stage holds no embedding (not the first pipeline stage)")
        return F.embedding(token_ids, self.embed)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, weight, self.cfg.rms_norm_eps)[0]
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def rope_for(self, positions: torch.Tensor) -> object:
        """What `pre_attention` rotates with: the positions (fused kernel) or their cos/sin."""
        return positions if self.fused is not None else self.rope.lookup_full(positions)

    def pre_attention(
        self, i: int, hidden: torch.Tensor, rope: object, lora: LoRAHook | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm → fused qkv (+LoRA) → rope (`rope_for`). Returns q [T, heads, d], k and v [T, kv_heads, d]."""
        cfg, w = self.cfg, self._layer(i)
        t = hidden.shape[0]
        if self.fused is None and self._cpu_fast(hidden, lora):  # norm, qkv and rope in one C++ call (rope: cos/sin)
            cos, sin = rope  # type: ignore[misc]
            return self.cpu_ops.rms_qkv_rope(hidden, w.input_norm, cfg.rms_norm_eps, w.wqkv, w.bqkv, cos, sin,
                                             cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        x = self._norm(hidden, w.input_norm)
        if lora is not None:
            lora.start(i, ("q_proj", "k_proj", "v_proj"), x)
        qkv = linear(x, w.wqkv, w.bqkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if lora is not None:
            lora.add(i, "q_proj", x, q)
            lora.add(i, "k_proj", x, k)
            lora.add(i, "v_proj", x, v)
        if self.fused is not None:
            assert isinstance(rope, torch.Tensor)
            q, k = self.fused.rope_qk(qkv, self.rope.cos, self.rope.sin, rope, cfg.num_heads, cfg.num_kv_heads,
                                      cfg.head_dim)
            return q, k, v.view(t, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = rope  # type: ignore[misc]
        # q and k side by side in qkv: one rotation for both (half the ops of a decode step's rope)
        qk = apply_rope_full(qkv[:, : cfg.q_size + cfg.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                        cos, sin)
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v.view(t, cfg.num_kv_heads, cfg.head_dim)

    def post_attention(
        self, i: int, attn: torch.Tensor, residual: torch.Tensor, lora: LoRAHook | None
    ) -> torch.Tensor:
        """o_proj (+LoRA) → residual → norm → SwiGLU MLP (+LoRA) → residual."""
        cfg, w = self.cfg, self._layer(i)
        attn = attn.reshape(attn.shape[0], cfg.q_size)
        if self._cpu_fast(residual, lora):  # o_proj + residual, norm, gate|up, SiLU-gate, down + residual: one call
            return self.cpu_ops.rms_mlp(attn.contiguous(), w.wo, residual, w.post_norm, cfg.rms_norm_eps, w.w13, w.w2)
        if lora is not None:
            lora.start(i, ("o_proj",), attn)
        o = linear(attn, w.wo)
        if lora is not None:
            lora.add(i, "o_proj", attn, o)
        if self.fused is not None:
            x, hidden = self.fused.rms_norm(o, w.post_norm, cfg.rms_norm_eps, residual=residual)
        else:
            hidden = residual + o
            x = rms_norm(hidden, w.post_norm, cfg.rms_norm_eps)
        if lora is not None:
            lora.start(i, ("gate_proj", "up_proj"), x)
        gate_up = linear(x, w.w13)
        gate, up = gate_up.split(cfg.intermediate_size, dim=-1)
        if lora is not None:
            lora.add(i, "gate_proj", x, gate)
            lora.add(i, "up_proj", x, up)
        act = self.fused.silu_mul(gate_up, cfg.intermediate_size) if self.fused is not None else F.silu(gate) * up
        if lora is not None:
            lora.start(i, ("down_proj",), act)
        down = linear(act, w.w2)
        if lora is not None:
            lora.add(i, "down_proj", act, down)
        return hidden + down

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None or self.final_norm is None:
            raise RuntimeError("this stage holds no lm_head (not the last pipeline stage)")
        if self._cpu_fast(hidden, None) and self.lm_head.is_contiguous():
            return self.cpu_ops.rms_small_linear(hidden, self.final_norm, self.cfg.rms_norm_eps, self.lm_head, None)
        return linear(self._norm(hidden, self.final_norm), self.lm_head)

    # --- a layer range ------------------------------------------------------------
    def run_layers(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        lora: LoRAHook | None = None,
    ) -> torch.Tensor:
        """Layers [start, end) on hidden [T, H] at `positions` [T]."""
        rope = self.rope_for(positions)
        for i in range(start, end):
            q, k, v = self.pre_attention(i, hidden, rope, lora)
            hidden = self.post_attention(i, attention(i, q, k, v), hidden, lora)
        return hidden

    def decode_layers(self, start: int, end: int, hidden: torch.Tensor, positions: torch.Tensor,
                      kv: DecodeKV) -> torch.Tensor | None:
        """Layers [start, end) of an all-decode step in one C++ call (gpu_ext/cpu_decode.py: norm, qkv,
        rope, the KV write, paged attention and the MLP of every layer, the same ops as `run_layers`
        with the C++ attention kernel, the same bits). None where it does not apply (no such op built,
        too many rows): the caller runs `run_layers`."""
        ops = self.cpu_ops
        if ops is None or self.fused is not None or not self._cpu_fast(hidden, None) or not hasattr(ops, "decode_layers"):
            return None
        lists = self._decode_lists(start, end)
        cos, sin = self.rope.lookup_full(positions)
        cfg = self.cfg
        return ops.decode_layers(hidden, *lists, cfg.rms_norm_eps, cos, sin, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, kv.keys, kv.values, kv.slots, kv.tables, kv.ctx_lens, kv.scale, kv.window)

    def _decode_lists(self, start: int, end: int) -> tuple[list[torch.Tensor], ...]:
        """Per-weight lists of layers [start, end) for `decode_layers`, kept while those layers' weights are."""
        layers = tuple(self._layer(i) for i in range(start, end))
        cached = self._lists
        if cached is not None and cached[0] == (start, end) and all(a is b for a, b in zip(cached[1], layers)):
            return cached[2]
        biases = [w.bqkv for w in layers]
        lists = ([w.input_norm for w in layers], [w.wqkv for w in layers],
                 [] if any(b is None for b in biases) else biases, [w.wo for w in layers],
                 [w.post_norm for w in layers], [w.w13 for w in layers], [w.w2 for w in layers])
        self._lists = ((start, end), layers, lists)
        return lists

    def _cpu_fast(self, x: torch.Tensor, lora: LoRAHook | None) -> bool:
        """The fused C++ projections apply: fp32 CPU ops built, no LoRA, a few contiguous rows."""
        return self.cpu_ops is not None and lora is None and x.shape[0] <= MAX_ROWS and x.is_contiguous()

    def _layer(self, i: int) -> LayerWeights:
        w = self.layers.get(i)
        if w is None:
            raise RuntimeError(f"layer {i} weights are not resident here (held: {sorted(self.layers)})")
        return w
