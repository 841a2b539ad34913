"""What operators look at, against a real cluster: `tidal status` shows each worker's pool and
instances, and every metric the Grafana dashboard queries is one the services really export
(scraped from each process's /metrics after the cluster has served requests)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import urllib.request

import pytest

from dashboard_queries import PROMETHEUS_MADE, dashboard, dashboard_queries, exported_series, metric_names
from e2e.assets import LLAMA, LORA, QWEN
from e2e.cluster import ClusterSpec, E2ECluster
from service_procs import ROOT

pytestmark = pytest.mark.timeout(240)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

CLUSTER_SPEC = ClusterSpec(workers={"w0": [LLAMA, QWEN], "w1": [LLAMA]}, resident_adapters={"w0": [LORA]},
                           metrics=True, control_plane=True)


def tidal_status(cluster: E2ECluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "LINES": "50", "TERM": "dumb"}
    return subprocess.run([sys.executable, "-m", "tidal", "status", "--nats", cluster.nats_url, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_status_shows_each_workers_pool_instances_and_adapters(cluster: E2ECluster) -> None:
    done = tidal_status(cluster, "--json")
    assert done.returncode == 0, done.stderr
    workers = {w["worker_id"]: w for w in json.loads(done.stdout)["workers"]}
    assert set(workers) == {"w0", "w1"}
    for worker_id, models in CLUSTER_SPEC.workers.items():
        stats = workers[worker_id]["stats"]
        assert stats is not None, f"no WorkerStats collected for {worker_id}"
        assert stats["pool"]["weights_bytes"] > 0 and stats["pool"]["kv_bytes"] > 0
        assert sorted(i["model"] for i in stats["instances"]) == sorted(models)
    assert LORA in workers["w0"]["stats"]["resident_adapters"]

    table = tidal_status(cluster)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, table.stdout
    for worker_id, row in workers.items():
        assert any(line.startswith(f"╭─ {worker_id} cpu alive") for line in lines), table.stdout
        for inst in row["stats"]["instances"]:
            assert inst["instance_id"] in table.stdout
    for label in ("weights", "prewarm", "adapter", "kv used", "kv free", "workspace", "free"):
        assert f"■ {label} " in table.stdout, label
    assert sum("█" * 40 in line for line in lines) == 2  # one pool bar per worker
    header = next(line.split() for line in lines if line.startswith("worker "))
    assert header == ["worker", "pool", "weights", "prewarm", "adapter", "kv", "workspace", "free"]
    for worker_id in workers:  # one line each: every kind in bytes and % of the pool
        assert next(line for line in lines if line.startswith(f"{worker_id} ")).count("%") == 6
    # the default planner (economy = fixed-order) buys nothing; said in one line, whether or not it answers
    assert sum(line.startswith("purchases: ") for line in lines) == 1, table.stdout
    assert f"resident adapters: {LORA}" in table.stdout


def frames(out: bytes) -> int:
    """How many times w1's panel was drawn (terminal escape sequences removed)."""
    return ANSI.sub("", out.decode(errors="replace")).count("╭─ w1 cpu alive")


def test_status_watch_redraws_in_place_until_ctrl_c(cluster: E2ECluster) -> None:
    """In a terminal (a pty, 80x60): several frames, each drawn over the last, and Ctrl-C exits 0."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "tidal", "status", "--nats", cluster.nats_url, "--watch", "0.2"],
                            cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm"})
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while frames(out) < 3 and time.monotonic() < deadline and proc.poll() is None:
            if select.select([master], [], [], 0.5)[0]:
                out += os.read(master, 65536)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert frames(out) >= 3, text[-3000:]
    assert "\x1b[2K" in text and "\x1b[1A" in text  # rich Live erases and moves up: a redraw in place
    assert "Traceback" not in text


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_every_dashboard_query_names_metrics_the_services_export(cluster: E2ECluster) -> None:
    client = cluster.openai()
    client.completions.create(model=LLAMA, prompt="count the waves", max_tokens=6, temperature=0)  # TPOT needs 2+
    client.chat.completions.create(model=LORA, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    report = json.loads(tidal_status(cluster, "--json").stdout)
    ports = {row["service"] + "/" + row["instance"]: row["metrics_port"] for row in report["services"]}
    assert {p.split("/")[0] for p in ports} == {"gateway", "dispatcher", "planner", "predictor", "registry",
                                                "gpu_worker"}
    assert all(ports.values()), ports
    exported: set[str] = set()
    for port in ports.values():
        exported |= exported_series(_scrape(port))

    queries = dashboard_queries(dashboard())
    assert len(queries) >= 20
    missing = [(where, name) for where, expr in queries for name in metric_names(expr)
               if name not in exported and name not in PROMETHEUS_MADE]
    assert missing == [], f"the dashboard reads metrics no service exports: {missing}"
    # the series it reads have samples where a served request puts them
    page = "".join(_scrape(port) for key, port in ports.items() if key.startswith(("gateway", "gpu_worker")))
    for sample in ("tidal_gateway_tpot_seconds_bucket", "tidal_gateway_ttft_seconds_bucket",
                   'tidal_worker_pool_bytes{kind="weights",worker="w0"}', "tidal_worker_kv_blocks_capacity{"):
        assert sample in page, sample
