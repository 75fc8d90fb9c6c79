"""The shipped monitoring files: Prometheus config, alert rules and their unit
tests, and the Grafana dashboard.

Two kinds of checks:
- promtool validates the config, the rules and every dashboard query, and
  runs the rule unit tests (alerts.test.yml). Without promtool these tests
  FAIL, so a missing tool never passes for a check; set EMBER_SKIP_PROMTOOL=1
  to skip them visibly instead.
- Every metric name an alert or a dashboard query uses must be exported by a
  real `ember serve` (metrics.py is the only place names are made, and a typo
  in a dashboard fails silently in Grafana).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ember.json"

# Series Prometheus makes itself rather than scraping them from Ember.
PROMETHEUS_INTERNAL = frozenset({"up"})
# Families a single successful chat request does not create series for: each
# gets its first sample when its event happens (an error, a rejection, a
# clamp, the controller or session tiers setting a value). They must still be
# declared (HELP/TYPE lines) by the server.
EVENT_DRIVEN = frozenset(
    {
        "llm_request_errors_total",
        "llm_requests_rejected_total",
        "llm_max_tokens_clamped_total",
        "llm_degraded",
        "llm_sessions",
        "llm_prefix_cache_hits_total",
        "llm_prefix_cache_queries_total",
        "llm_gc_pause_seconds_bucket",  # a collection while serving
        "llm_gc_pause_seconds_count",
    }
)


# ---------------------------------------------------------------- promtool


@pytest.fixture(scope="module")
def promtool() -> str:
    """Path of promtool; a missing promtool fails unless EMBER_SKIP_PROMTOOL=1."""
    path = shutil.which("promtool")
    if path is not None:
        return path
    if os.environ.get("EMBER_SKIP_PROMTOOL") == "1":
        pytest.skip("promtool is not installed and EMBER_SKIP_PROMTOOL=1: alert rules and dashboard queries NOT checked")
    pytest.fail(
        "promtool is not on PATH, so the alert rules cannot be checked. Install it "
        "(Debian/Ubuntu: apt-get install -y --no-install-recommends prometheus) "
        "or set EMBER_SKIP_PROMTOOL=1 to skip these checks."
    )


def run_promtool(promtool: str, *args: str, cwd: Path = PROMETHEUS_DIR) -> str:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_prometheus_config_and_rules_are_valid(promtool: str) -> None:
    # check config also loads rule_files, so a wrong path to alerts.yml fails here.
    run_promtool(promtool, "check", "config", "prometheus.yml")
    run_promtool(promtool, "check", "rules", ALERTS.name)


def test_alert_rule_unit_tests_pass(promtool: str) -> None:
    run_promtool(promtool, "test", "rules", ALERT_TESTS.name)


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    alert_names = {rule["alert"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"] if "alert" in rule}
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in load_yaml(ALERT_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alert_names - firing == set(), "alerts never shown firing in alerts.test.yml"
    assert alert_names - quiet == set(), "alerts never shown quiet in alerts.test.yml"


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    # promtool has no "check this expression"; a recording rule per query does it.
    rules = [
        {"record": f"ember:dashboard_query:{i}", "expr": grafana_to_promql(expr)}
        for i, expr in enumerate(dashboard_queries(load_dashboard()))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool(promtool, "check", "rules", str(path), cwd=tmp_path)


# --------------------------------------------------------------- dashboard


def test_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"]
    panels = list(all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", "panels use the data source variable"
    titles = " ".join(p["title"].lower() for p in graphs)
    for topic in ("first token", "inter-token", "end-to-end", "tokens per second", "requests per second",
                  "waiting", "kv cache", "sessions", "degraded", "errors by code"):
        assert topic in titles, f"no panel about {topic!r}"


# ------------------------------------------------------- metric names exist


def test_metric_name_extraction() -> None:
    """The extractor must see metrics and nothing else (functions, labels, keywords, variables)."""
    expr = (
        'histogram_quantile(0.99, sum by (le, tier) (rate(llm_x_bucket{code=~"5..", instance=~"$instance"}[$__rate_interval])))'
        " / ignoring(tier) group_left sum without (model) (llm_y_total offset 5m) > bool 2e3 and on(instance) up == 0"
        " or absent(llm_z) unless llm_w:ratio + on_disk_bytes + bytes_total"
    )
    assert metric_names(expr) == {"llm_x_bucket", "llm_y_total", "up", "llm_z", "llm_w:ratio", "on_disk_bytes", "bytes_total"}
    assert metric_names("label_values(llm_ready, instance)") == {"llm_ready"}


@pytest.fixture(scope="module")
def scraped(server) -> str:
    """/metrics of a live server after one small chat request (so histograms have samples)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return server.metrics()


def test_alerts_and_dashboard_use_only_exported_metrics(scraped: str) -> None:
    declared, with_samples = exported_names(scraped)
    referenced = referenced_metric_names()
    assert {"llm_request_duration_seconds_bucket", "llm_kv_cache_usage_ratio", "llm_sessions", "llm_degraded"} <= referenced
    missing = referenced - declared - PROMETHEUS_INTERNAL
    assert missing == set(), f"used by alerts.yml / ember.json but not exported by ember serve: {sorted(missing)}"
    # A declared family must also have samples unless only an event creates them.
    empty = referenced - with_samples - PROMETHEUS_INTERNAL - EVENT_DRIVEN
    assert empty == set(), f"exported without samples after a chat request: {sorted(empty)}"


def exported_names(text: str) -> tuple[set[str], set[str]]:
    """(series names the declared families can have, series names that have samples).

    A histogram family ``f`` exposes ``f_bucket``, ``f_sum`` and ``f_count``;
    a counter ``f`` exposes ``f_total``; a gauge ``f`` is just ``f``. Declared
    means a ``# TYPE`` line, which prometheus_client writes even for a labelled
    metric that has no series yet.
    """
    declared: set[str] = set()
    with_samples: set[str] = set()
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "summary": ("_sum", "_count")}
    for family in text_string_to_metric_families(text):
        declared.update(family.name + s for s in suffixes.get(family.type, ("",)))
        with_samples.update(sample.name for sample in family.samples)
    return declared, with_samples


def referenced_metric_names() -> set[str]:
    exprs = [rule["expr"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]
    exprs += dashboard_queries(load_dashboard())
    exprs += [v["query"] for v in load_dashboard()["templating"]["list"] if v["type"] == "query"]
    names: set[str] = set()
    for expr in exprs:
        names |= metric_names(expr)
    return names


# PromQL words that look like identifiers but are not metrics.
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
# Label lists after these keywords: by (le), on(instance), group_left(tier)...
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\b\s*(?:\([^)]*\))?")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana ``label_values(metric, label)``).

    Not a parser: strips what can hold identifiers that are not metrics
    (strings, label matchers, ranges, Grafana variables, label lists), then
    keeps identifiers that are not followed by "(" (functions) nor keywords.
    """
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr, re.S)
    if m:
        expr = m.group(1)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    expr = _LABEL_LIST.sub(" ", expr)
    return {name for name in _IDENTIFIER.findall(expr) if name.lower() not in _KEYWORDS}


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables with values Prometheus accepts."""
    return expr.replace("$__rate_interval", "5m").replace("$instance", ".*")


# ----------------------------------------------------------------- helpers


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]
