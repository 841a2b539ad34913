"""A worker's stats say how many admitted requests use each device-resident adapter (`users`): the
planner offers only adapters with none for offload (shared/planner/view.evictable_adapters)."""
from __future__ import annotations

from types import SimpleNamespace

from services.gpu_worker.admission import adapter_users
from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.stats import adapter_residency


def test_admitted_requests_are_counted_per_adapter() -> None:
    active = {f"r{i}": SimpleNamespace(assignment=SimpleNamespace(adapter=name))
              for i, name in enumerate(["a", "a", None, "b"])}
    assert adapter_users(active) == {"a": 2, "b": 1}  # type: ignore[arg-type]


def test_users_land_on_the_device_rows_only() -> None:
    snaps = [InstanceSnapshot(adapter_residency=(("a", "device", False, 8, 100), ("a", "host", False, 8, 100),
                                                 ("c", "device", False, 8, 50))),
             InstanceSnapshot(adapter_residency=(("a", "device", False, 8, 100),))]
    rows = {(r.adapter, r.level): (r.bytes, r.users) for r in adapter_residency(snaps, {"a": 3, "z": 1})}
    assert rows == {("a", "device"): (200, 3), ("a", "host"): (100, 0), ("c", "device"): (50, 0)}
    assert all(r.users == 0 for r in adapter_residency(snaps))  # no table: none counted
