"""Fixtures of the end-to-end suite: tiny checkpoints (per session), the oracle, a cluster per module.

A test module picks its cluster with a module-level `CLUSTER_SPEC = ClusterSpec(...)`; without
one it gets `DEFAULT_SPEC`: two workers, `w0` serving both models, `w1` the llama one, the
LoRA adapter of the llama model resident on both. Tests of a module share its cluster, so
they must leave it as they found it (streams finished or aborted).
"""
from __future__ import annotations

import pytest

from e2e.assets import LLAMA, LORA, QWEN, Oracle, TinyAssets, make_assets
from e2e.cluster import ClusterSpec, E2ECluster
from e2e.observer import Observer

DEFAULT_SPEC = ClusterSpec(workers={"w0": [LLAMA, QWEN], "w1": [LLAMA]},
                           resident_adapters={"w0": [LORA], "w1": [LORA]})


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return make_assets(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def oracle(tiny_assets: TinyAssets) -> Oracle:
    return Oracle(tiny_assets)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tiny_assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory):
    spec = getattr(request.module, "CLUSTER_SPEC", DEFAULT_SPEC)
    running = E2ECluster(tmp_path_factory.mktemp("cluster"), spec, tiny_assets).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def observer(cluster: E2ECluster):
    watching = await Observer().start(cluster.nats_url)
    try:
        yield watching
    finally:
        await watching.stop()
