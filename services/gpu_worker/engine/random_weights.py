"""Random weights shaped like a checkpoint's, made where they are asked for, as the runner holds them.

For runs that need a model's geometry and not its values (a step's cost does not depend on the
weights): the CUDA engine bench makes an 8B model's on the device, and `tidal profile gpu` makes
them on the device, copies them to host memory and times the load back (loadgen/profiler/
gpu_profile.py). The tensors are the runner's packed layout (`LayerWeights`: qkv and gate/up fused).
"""
from __future__ import annotations

import torch

from services.gpu_worker.engine.models.llama import LayerWeights
from services.gpu_worker.engine.preloaded import PreloadedWeights


def random_weights(cfg, model_dir: str, device: torch.device, seed: int = 0) -> PreloadedWeights:  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=device).manual_seed(seed)

    def mat(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=cfg.dtype, device=device).normal_(0, std or cols**-0.5, generator=gen)

    def norm(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=cfg.dtype, device=device).normal_(1.0, 0.1, generator=gen)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layers = {
        i: LayerWeights(input_norm=norm(h), wqkv=mat(q + 2 * kv, h),
                        bqkv=norm(q + 2 * kv) - 1 if cfg.qkv_bias else None, wo=mat(h, q), post_norm=norm(h),
                        w13=mat(2 * inter, h), w2=mat(h, inter))
        for i in range(cfg.num_layers)
    }
    embed = mat(cfg.vocab_size, h, 2.5 * h**-0.5 if cfg.tie_word_embeddings else 1.0)
    head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, h)
    return PreloadedWeights(model_dir=model_dir, layers=layers, embed=embed, final_norm=norm(h), lm_head=head)


def _tensors(w: PreloadedWeights) -> list[torch.Tensor]:
    out = [t for t in (w.embed, w.final_norm) if t is not None]
    if w.lm_head is not None and w.lm_head is not w.embed:
        out.append(w.lm_head)
    for layer in w.layers.values():
        out += [t for t in (layer.input_norm, layer.wqkv, layer.bqkv, layer.wo, layer.post_norm, layer.w13, layer.w2)
                if t is not None]
    return out


def weights_bytes(w: PreloadedWeights) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(w))


def moved(w: PreloadedWeights, device: torch.device | str, *, pin: bool = False) -> PreloadedWeights:
    """The same weights in `device` memory (page-locked host memory with `pin`), tied tensors kept tied."""
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if pin:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t)
            return out
        return t.to(device, non_blocking=True, copy=True)  # a copy on the same device too (a CPU run)

    embed = to(w.embed)
    head = embed if w.lm_head is w.embed else to(w.lm_head)
    layers = {i: LayerWeights(input_norm=to(l.input_norm), wqkv=to(l.wqkv), bqkv=to(l.bqkv), wo=to(l.wo),
                              post_norm=to(l.post_norm), w13=to(l.w13), w2=to(l.w2))
              for i, l in w.layers.items()}
    return PreloadedWeights(model_dir=w.model_dir, layers=layers, embed=embed, final_norm=to(w.final_norm), lm_head=head)


__all__ = ["moved", "random_weights", "weights_bytes"]
