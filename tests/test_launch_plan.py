"""What `tidal up` starts, from the config (pure)."""
from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import parse_config
from tidal.launch_plan import plan_children

CONFIG = """
[gateway]
drain_timeout = "20s"
[observability]
metrics_port_base = 9100
[[workers]]
id = "cpu-0"
memory = "64MiB"
[[workers]]
id = "cpu-1"
memory = "64MiB"
"""


def plan(**kw):
    cfg = parse_config(CONFIG, base_dir=Path("/tmp"))
    return plan_children(cfg, nats_url="nats://10.0.0.1:4222", config_path="/etc/tidal.toml", run_id="abc",
                         logs_dir=Path("/logs"), **kw)


def test_registry_first_one_worker_process_per_configured_worker():
    children = plan()
    assert [c.label for c in children] == [
        "registry", "predictor", "planner", "dispatcher", "gpu_worker-cpu-0", "gpu_worker-cpu-1", "gateway"]
    w1 = children[5]
    argv = w1.argv(0)
    assert argv[1:3] == ["-m", "services.gpu_worker"]
    assert argv[argv.index("--worker-id") + 1] == "cpu-1"
    assert "--nats" not in argv and children[0].env["TIDAL_NATS_URL"] == "nats://10.0.0.1:4222"  # not in `ps`
    assert argv[argv.index("--config") + 1] == "/etc/tidal.toml"
    assert argv[argv.index("--metrics-port") + 1] == "9111"  # base + 10 + index
    assert w1.log_path == Path("/logs/gpu_worker-cpu-1.log")


def test_instances_are_unique_and_restarts_get_a_new_one():
    children = plan()
    instances = [c.instance(0) for c in children]
    assert len(set(instances)) == len(instances)
    gateway = children[-1]
    assert gateway.instance(2) == gateway.instance(0) + "-r2" and gateway.drain_timeout_s == 20.0
    assert gateway.argv(2)[gateway.argv(2).index("--instance") + 1] == gateway.instance(2)


def test_subsets_for_multi_host_and_unknown_names_refused():
    assert [c.label for c in plan(services=["gpu_worker"], workers=["cpu-1"])] == ["gpu_worker-cpu-1"]
    with pytest.raises(ValueError, match="unknown service"):
        plan(services=["scheduler"])
    with pytest.raises(ValueError, match="unknown worker"):
        plan(workers=["cpu-9"])
