"""The cold-start rule's choices as `tidal_worker_lora_cold_starts` (services/gpu_worker/cold_metrics.py)."""
from __future__ import annotations

from services.gpu_worker.cold_metrics import export_cold_choices
from shared.metrics import REGISTRY


def _value(worker: str, instance: str, choice: str) -> float | None:
    return REGISTRY.get_sample_value("tidal_worker_lora_cold_starts",
                                     {"worker": worker, "instance": instance, "choice": choice})


def test_counts_per_instance_and_choice_and_gone_instances_lose_their_series():
    export_cold_choices("w-cold", [("i1", {"cpu_assist": 3, "async": 1, "inline": 0}),
                                   ("i2", {"cpu_assist": 0, "async": 0, "inline": 2})])
    assert _value("w-cold", "i1", "cpu_assist") == 3 and _value("w-cold", "i1", "async") == 1
    assert _value("w-cold", "i2", "inline") == 2
    export_cold_choices("w-cold", [("i1", {"cpu_assist": 4, "async": 1, "inline": 0})])
    assert _value("w-cold", "i1", "cpu_assist") == 4
    assert _value("w-cold", "i2", "inline") is None  # the instance went away


def test_the_dashboard_shows_the_choices_by_choice():
    from dashboard_queries import dashboard, dashboard_queries

    exprs = [e for _w, e in dashboard_queries(dashboard()) if "tidal_worker_lora_cold_starts" in e]
    assert exprs and any("by (choice)" in e and '$worker' in e for e in exprs)
