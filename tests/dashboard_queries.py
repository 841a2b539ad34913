"""Test helpers: the PromQL of the Grafana dashboard, the metric names it reads, what a /metrics page exports,
and what the code declares (read statically, without importing the services)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "tidal.json"

# Series Prometheus makes itself for every target: not exported by any service.
PROMETHEUS_MADE = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_FUNCTIONS_AND_KEYWORDS = frozenset({
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "stdvar", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "label_values", "clamp_min",
    "clamp_max", "abs", "ceil", "floor", "round", "time", "vector", "scalar", "absent", "sort", "sort_desc",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "last_over_time", "inf", "nan",
})
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,()]+?)\s*,\s*[A-Za-z_][A-Za-z0-9_]*\s*\)")  # (metric, label)
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and query variable, rows' nested panels included."""
    found: list[tuple[str, str]] = []

    def panels(items: list[dict]) -> None:
        for panel in items:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((f"panel {panel.get('title')!r}", target["expr"]))
            panels(panel.get("panels", []))

    panels(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query" and text:
            found.append((f"variable {var['name']!r}", text))
    return found


def metric_names(expr: str) -> set[str]:
    """The metric (series) names an expression selects."""
    text = _LABEL_VALUES.sub(r" \1 ", expr)
    text = _STRINGS.sub('""', text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group(1)
        after = text[match.end():].lstrip()
        if name.lower() in _FUNCTIONS_AND_KEYWORDS or after.startswith("("):
            continue
        names.add(name)
    return names


# the series each prometheus_client metric type exposes for a declared name (a Counter's `_total` is its own)
_SUFFIXES = {"Counter": ("_total", "_created"), "Histogram": ("_bucket", "_count", "_sum", "_created"),
             "Summary": ("", "_count", "_sum", "_created"), "Gauge": ("",), "Info": ("_info",), "Enum": ("",)}
DECLARING = ("services", "shared", "tidal")  # the packages that run in a service process


def declared_series(root: Path = ROOT) -> dict[str, str]:
    """Series name -> the file declaring it, for every `Counter("name", ...)`, `Gauge(...)`, ... whose name is a
    literal in the packages' code (every metric of this repository is declared so)."""
    found: dict[str, str] = {}
    for top in DECLARING:
        for path in sorted((root / top).rglob("*.py")):
            text = path.read_text()
            if "prometheus_client" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if not isinstance(node, ast.Call):
                    continue
                kind = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                named = node.args[:1] or [k.value for k in node.keywords if k.arg == "name"]
                if kind not in _SUFFIXES or not named or not isinstance(named[0], ast.Constant):
                    continue
                name = str(named[0].value)
                base = name.removesuffix("_total") if kind == "Counter" else name
                for suffix in _SUFFIXES[kind]:
                    found[base + suffix] = str(path.relative_to(root))
    return found


def exported_series(page: str) -> set[str]:
    """Series names a /metrics page can produce, from its families (so a labelled metric that has no
    sample yet, like a counter of migrations before the first one, still counts)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",),
                "stateset": ("",), "gaugehistogram": ("_bucket", "_gcount", "_gsum"), "unknown": ("",)}
    names: set[str] = set()
    for family in text_string_to_metric_families(page):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names
