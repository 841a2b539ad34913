"""compose/'s Prometheus and Grafana without a Docker engine: targets, mounts, provisioning, dashboard.

That every metric the dashboard reads is declared in the code is checked here (statically); that the
services really export it, against a live cluster in tests/e2e/test_e2e_observability.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dashboard_queries import PROMETHEUS_MADE, dashboard, dashboard_queries, declared_series, metric_names

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def _container_ports(compose: dict) -> dict[str, str]:
    """Each Tidal container's metrics port, as the compose environment sets it."""
    ports = {}
    for name, service in compose["services"].items():
        if "build" in service:
            ports[name] = str(service["environment"]["TIDAL_METRICS_PORT"])
    return ports


def test_prometheus_scrapes_every_tidal_container_on_its_metrics_port(compose):
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, str] = {}
    for job in prom["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in compose["services"], f"{job['job_name']}: no compose service {host!r}"
                targets[host] = port
    assert targets == _container_ports(compose)  # every container, each on the port it serves
    jobs = {job["job_name"] for job in prom["scrape_configs"]}
    modules = {s["command"][s["command"].index("-m") + 1] for s in compose["services"].values() if "build" in s}
    assert jobs == {m.split(".")[1] for m in modules}  # one job per service, named after it


def test_every_bind_mount_exists_in_the_repo(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name}: {source} is not in compose/"
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} not declared"


def test_grafana_provisioning_parses_and_points_at_what_is_mounted(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: COMPOSE / v.split(":")[0] for v in grafana["volumes"] if v.startswith(".")}
    datasources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    providers = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/tidal.yml").read_text())
    (provider,) = providers["providers"]
    folder = mounts[provider["options"]["path"]]
    assert (folder / "tidal.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[str(Path(home).parent)] / Path(home).name).is_file()
    assert set(mounts) >= {"/etc/grafana/provisioning/datasources", "/etc/grafana/provisioning/dashboards"}
    # every panel queries the provisioned data source
    uid = source["uid"]
    for panel in dashboard()["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]
            assert all(t["datasource"]["uid"] == uid for t in panel["targets"]), panel["title"]


def test_dashboard_has_the_panels_people_look_for():
    dash = dashboard()
    titles = {p["title"] for p in dash["panels"]}
    assert {"Request rate", "TTFT", "TPOT", "E2E latency", "Tokens/s", "Queue depth", "KV use",
            "Memory pool by kind", "Migrations", "Memory purchases"} <= titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = set().union(*(metric_names(e) for _w, e in dashboard_queries(dash)))
    for histogram in ("tidal_gateway_ttft_seconds", "tidal_gateway_tpot_seconds", "tidal_gateway_request_seconds"):
        assert f"{histogram}_bucket" in names
    for _where, expr in dashboard_queries(dash):
        if "histogram_quantile" in expr:
            assert "by (le" in expr, expr  # a quantile needs the buckets kept apart


def test_metric_name_extraction_ignores_functions_labels_and_ranges():
    expr = ('histogram_quantile(0.95, sum by (le, mode) (rate(tidal_x_seconds_bucket{worker=~"$worker", a="by (b)"}'
            '[$__rate_interval]))) / on (worker) group_left sum without (kind) (tidal_y_bytes)')
    assert metric_names(expr) == {"tidal_x_seconds_bucket", "tidal_y_bytes"}
    assert metric_names("label_values(tidal_worker_pool_capacity_bytes, worker)") == {"tidal_worker_pool_capacity_bytes"}


def test_every_metric_a_panel_or_variable_reads_is_declared_in_the_code():
    declared = declared_series()
    assert {"tidal_worker_pool_bytes", "tidal_gateway_ttft_seconds_bucket", "tidal_plan_effects_total",
            "tidal_planner_purchases_total", "tidal_planner_purchase_price_request_s_bucket",
            "tidal_planner_purchase_outcomes_total"} <= declared.keys()
    queries = dashboard_queries(dashboard())
    missing = sorted({(where, name) for where, expr in queries for name in metric_names(expr)
                      if name not in declared and name not in PROMETHEUS_MADE})
    assert missing == [], f"the dashboard reads metrics no code declares: {missing}"


def test_declared_series_follow_each_metric_type(tmp_path):
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "m.py").write_text(
        "from prometheus_client import Counter, Gauge, Histogram\n"
        'A = Counter("tidal_a_total", "a", ["x"])\nB = prometheus_client.Histogram(\n    "tidal_b_seconds", "b")\n'
        'C = Gauge(name="tidal_c_bytes", documentation="c")\nD = Counter(NAME, "not a literal")\n')
    assert set(declared_series(tmp_path)) == {
        "tidal_a_total", "tidal_a_created", "tidal_b_seconds_bucket", "tidal_b_seconds_count", "tidal_b_seconds_sum",
        "tidal_b_seconds_created", "tidal_c_bytes"}


def test_the_memory_economy_panels_read_the_pool_per_worker_and_the_purchases():
    panels = {p["title"]: p for p in dashboard()["panels"]}
    device = panels["Device memory by kind: $worker"]
    worker = next(v for v in dashboard()["templating"]["list"] if v["name"] == "worker")
    assert device["repeat"] == "worker" and worker["multi"] and worker["includeAll"]  # one panel per selected worker
    assert device["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    (expr,) = [t["expr"] for t in device["targets"]]
    assert metric_names(expr) == {"tidal_worker_pool_bytes"} and "by (kind)" in expr and '"$worker"' in expr
    colours = {o["matcher"]["options"] for o in device["fieldConfig"]["overrides"]}
    assert colours == {"weights", "prewarm", "adapter", "kv", "workspace", "free"}  # the kinds the worker exports
    purchases = panels["Memory purchases"]
    names = [metric_names(t["expr"]) for t in purchases["targets"]]
    assert names[0] == {"tidal_planner_purchases_total"} and "by (source)" in purchases["targets"][0]["expr"]
    assert all(n.startswith("tidal_planner_purchase_price_request_s") for n in names[1])
    rows = [p for p in dashboard()["panels"] if p["type"] == "row"]
    economy = next(r for r in rows if r["title"] == "Memory economy")
    outcomes = panels["Purchase outcomes"]  # applied / refused / failed, beside the purchases
    assert [metric_names(t["expr"]) for t in outcomes["targets"]] == [{"tidal_planner_purchase_outcomes_total"}] * 2
    assert "by (source, outcome)" in outcomes["targets"][0]["expr"]
    assert outcomes["gridPos"]["y"] == purchases["gridPos"]["y"]
    assert outcomes["gridPos"]["x"] >= purchases["gridPos"]["x"] + purchases["gridPos"]["w"]  # no overlap
    assert all(p["gridPos"]["y"] > economy["gridPos"]["y"] for p in (device, purchases))
