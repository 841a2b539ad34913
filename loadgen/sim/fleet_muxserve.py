"""A MuxServe-like static co-location (WarmServe §7.1's GPU-sharing baseline) as fleet instances.

MuxServe places models on GPU meshes before serving and never scales. A mesh either holds one
model, which then runs data-parallel instances at its own TP degree owning their GPUs, or
several models sharing the mesh (CUDA MPS): each gets one instance spanning the whole mesh
(MuxServe enlarges the parallelism to co-locate), a compute share proportional to its expected
compute demand (request share x parameters), and the mesh's memory left after all the weights
as KV in the same proportion. Shares are fixed: a model whose load shifts above its share
queues (what §7.3 observes under heavy load).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from loadgen.sim.fleet_profile import BLOCK_TOKENS, FleetProfile
from loadgen.sim.fleet_state import StaticInstance

MUX_MAX_BATCH = 256  # vLLM's default max_num_seqs; MuxServe sizes batches itself, KV permitting


def muxserve_instances(profile: FleetProfile, meshes: Sequence[tuple[Sequence[int], Sequence[str]]],
                       request_share: Mapping[str, float]) -> tuple[StaticInstance, ...]:
    """`meshes`: (GPU indices, models) each; `request_share`: each model's share of the requests."""
    out: list[StaticInstance] = []
    seen: set[str] = set()
    for gpus, models in meshes:
        if not models or seen & set(models):
            raise ValueError(f"mesh {list(gpus)}: needs models, each on one mesh only, got {list(models)}")
        seen |= set(models)
        specs = [profile.model(name) for name in models]
        if len(specs) == 1:
            m = specs[0]
            if len(gpus) % m.parallel:
                raise ValueError(f"mesh {list(gpus)}: {len(gpus)} GPUs are not a multiple of {m.name}'s {m.parallel}")
            for k in range(0, len(gpus), m.parallel):
                out.append(StaticInstance(m.name, tuple(gpus[k:k + m.parallel]), 1.0, profile.kv_blocks(m),
                                          MUX_MAX_BATCH))
            continue
        demand = {m.name: request_share.get(m.name, 0.0) * m.params for m in specs}
        total = sum(demand.values())
        if total <= 0:
            raise ValueError(f"mesh {list(gpus)}: its models {list(models)} have no expected requests")
        kv_bytes = len(gpus) * profile.gpu.usable_bytes - sum(m.weights_bytes for m in specs)
        if kv_bytes <= 0:
            raise ValueError(f"mesh {list(gpus)}: the weights of {list(models)} do not fit")
        for m in specs:
            share = max(demand[m.name] / total, 0.01)
            blocks = int(kv_bytes * share) // (m.kv_bytes_per_token * BLOCK_TOKENS)
            out.append(StaticInstance(m.name, tuple(gpus), share, blocks, MUX_MAX_BATCH))
    return tuple(out)
