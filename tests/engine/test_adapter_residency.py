"""Adapter residency: the LRU level (pure), pinning, the bounded host repository (real LoRAManager)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.adapter_lru import AdapterLRU
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.lora import LoRAManager, load_adapter
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_config import load_model_config


# --- the pure level ----------------------------------------------------------------------
def test_lru_order_and_pins() -> None:
    lru = AdapterLRU()
    for name in "abcd":
        lru.add(name, 10)
    lru.touch("a")  # order now b c d a
    assert lru.victim() == "b"
    lru.pin("b")
    assert lru.victim() == "c" and lru.victim(keep={"c"}) == "d"
    lru.pin("c"), lru.pin("d"), lru.pin("a")
    assert lru.victim() is None  # only pinned left: nothing may go
    lru.unpin("d")
    assert lru.victim() == "d"
    lru.remove("b")
    assert "b" not in lru and "b" not in lru.pinned and lru.bytes == 30
    with pytest.raises(KeyError, match="'zz' is not held"):
        lru.pin("zz")


def test_bounded_level_names_victims_oldest_first_and_never_pinned() -> None:
    lru = AdapterLRU(limit_bytes=100)
    for name, size in (("a", 40), ("b", 30), ("c", 30)):
        lru.add(name, size)
    assert not lru.over_limit() and lru.over_limit(extra=1)
    assert lru.victims_for(50) == ["a", "b"]  # 50 more must leave at most 50 held: 40 + 30 go, oldest first
    lru.pin("a")
    assert lru.victims_for(50) == ["b", "c"]
    assert lru.victims_for(61) is None  # only 60 B can be freed; 40 are pinned
    assert lru.victims_for(101) is None and AdapterLRU().victims_for(10**12) == []
    with pytest.raises(ValueError, match="limit_bytes"):
        AdapterLRU(-1)


# --- the manager, on a real model and real adapters --------------------------------------
@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("residency")
    base = make_model(root / "base", layers=2, hidden=64)
    return base, {f"a{i}": make_lora(root / f"a{i}", base, rank=8, seed=i) for i in range(4)}


def manager(base: Path, pool_bytes: int = 8 << 20, **kw) -> LoRAManager:  # type: ignore[no-untyped-def]
    return LoRAManager(load_model_config(base), range(2), MemoryPool(pool_bytes), **kw)


def test_pinned_adapter_is_never_evicted(assets) -> None:  # type: ignore[no-untyped-def]
    base, paths = assets
    lora = manager(base, max_resident=2)
    for name, path in paths.items():
        lora.register(name, path)
    lora.pin("a0")
    for name in ("a1", "a2", "a3", "a1", "a2"):
        lora.ensure_resident([name])
        assert "a0" in lora.resident  # LRU evicts around it
    assert list(lora.resident) == ["a0", "a2"]
    rows = {(n, level): pinned for n, level, pinned, _, _ in lora.residency()}
    assert rows[("a0", "device")] is True and rows[("a2", "device")] is False
    assert lora.room_bytes() == lora.pool.free_bytes + lora.host["a2"].nbytes  # a0 is not evictable room
    lora.unpin("a0")
    lora.ensure_resident(["a3"])
    assert "a0" not in lora.resident


def test_pinning_without_device_room_is_refused_and_unregisters(assets) -> None:  # type: ignore[no-untyped-def]
    base, paths = assets
    cfg = load_model_config(base)
    one = load_adapter(paths["a0"], "a0", cfg, range(2)).nbytes
    lora = manager(base, pool_bytes=int(one * 1.5))
    lora.install(load_adapter(paths["a0"], "a0", cfg, range(2)), paths["a0"], pinned=True)
    with pytest.raises(MemoryError):
        lora.install(load_adapter(paths["a1"], "a1", cfg, range(2)), paths["a1"], pinned=True)
    assert "a1" not in lora.host and list(lora.resident) == ["a0"]


def test_host_repository_is_bounded_and_spilled_adapters_come_back(assets) -> None:  # type: ignore[no-untyped-def]
    base, paths = assets
    lora = manager(base)
    one = load_adapter(paths["a0"], "a0", lora.cfg, range(2)).nbytes
    lora.set_host_limit(2 * one)
    for name, path in paths.items():
        lora.register(name, path)
    assert lora.host_lru.bytes <= 2 * one and list(lora.host_lru) == ["a2", "a3"]
    assert set(lora.spilled) == {"a0", "a1"} and set(lora.host) == set(paths)  # all still registered
    assert lora.rank("a0") == 8
    lora.ensure_resident(["a0"])  # read again from its directory; "a2" (least recent) spills
    expected = load_adapter(paths["a0"], "a0", lora.cfg, range(2))
    for key, (a, b) in expected.weights.items():
        assert torch.equal(lora.resident["a0"][0].weights[key][0], a)
        assert torch.equal(lora.resident["a0"][0].weights[key][1], b)
    assert list(lora.host_lru) == ["a3", "a0"] and "a2" in lora.spilled
    levels = {(n, level) for n, level, *_ in lora.residency()}
    assert levels == {("a0", "device"), ("a3", "host"), ("a0", "host")}
    lora.unregister("a2")
    assert "a2" not in lora.host and "a2" not in lora.spilled


def test_an_adapter_with_no_directory_is_never_spilled(assets) -> None:  # type: ignore[no-untyped-def]
    base, paths = assets
    lora = manager(base)
    one = load_adapter(paths["a0"], "a0", lora.cfg, range(2)).nbytes
    lora.set_host_limit(one)
    lora.install(load_adapter(paths["a0"], "a0", lora.cfg, range(2)))  # no path: cannot be read back
    with pytest.raises(MemoryError, match="does not fit the host repository"):
        lora.register("a1", paths["a1"])
    assert "a0" in lora.host_lru and "a1" not in lora.host


def test_offload_frees_the_device_copy_and_keeps_the_adapter_registered(assets) -> None:  # type: ignore[no-untyped-def]
    base, paths = assets
    lora = manager(base)
    for name in ("a0", "a1"):
        lora.register(name, paths[name])
    lora.ensure_resident(["a0", "a1"])
    free, nbytes = lora.pool.free_bytes, lora.host["a0"].nbytes
    assert lora.pool.by_owner()["lora"]["lora:a0"] == nbytes
    assert lora.offload("a0") == nbytes
    assert lora.pool.free_bytes == free + nbytes and "lora:a0" not in lora.pool.by_owner().get("lora", {})
    assert "a0" not in lora.resident and "a1" in lora.resident  # only its device copy went
    rows = {(n, level) for n, level, _, _, _ in lora.residency()}
    assert ("a0", "host") in rows and ("a0", "device") not in rows and "a0" in lora.host
    assert lora.offload("a0") == 0  # no device copy: nothing to free (idempotent)
    before = {k: (a.clone(), b.clone()) for k, (a, b) in lora.host["a0"].weights.items()}
    lora.ensure_resident(["a0"])  # its next use loads it again, from the host copy
    assert all(torch.equal(lora.resident["a0"][0].weights[k][0], a) for k, (a, _) in before.items())
    lora.pin("a1")
    with pytest.raises(ValueError, match="'a1' is pinned"):
        lora.offload("a1")
    assert "a1" in lora.resident
    with pytest.raises(KeyError, match="unknown LoRA adapter 'zz'"):
        lora.offload("zz")
