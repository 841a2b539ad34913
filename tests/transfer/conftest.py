"""Fixtures of the live-migration tests; each test file provides its own `cluster`
(a `migrate_cluster.MigrationCluster`) with the workers it needs."""
from __future__ import annotations

import pytest

from migrate_cluster import MigrationCluster, reference_engine
from services.gpu_worker.engine.engine import LLMEngine
from shared.bus import Bus, BusSettings


@pytest.fixture(scope="module")
def reference(cluster: MigrationCluster) -> LLMEngine:
    """The workers' model and adapter in process: what an unmigrated run yields."""
    return reference_engine(cluster.config)


@pytest.fixture
async def bus(cluster: MigrationCluster):  # type: ignore[no-untyped-def]
    bus = await Bus.connect(BusSettings(url=cluster.url), service="test")
    yield bus
    await bus.close()
