"""The Grafana dashboard and the alert rules may only query metrics the sink exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from seektrain.observe.names import EXPORTED_METRICS

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "seektrain-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
PROMETHEUS_BUILTIN = {"up"}  # synthesized by Prometheus for every target


def metric_identifiers(expr: str) -> set[str]:
    """Metric names in a PromQL expression: drop strings, label matchers, ranges, grouping clauses,
    Grafana variables, then keep identifiers that are not functions (followed by '(') or keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the "e" of 1e3 or a duration suffix
        names.add(word)
    return names


def dashboard_exprs(node) -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                found.append(value["query"])
            else:
                found.extend(dashboard_exprs(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(dashboard_exprs(item))
    return found


def test_identifier_parser():
    expr = 'avg_over_time(seektrain_tokens_per_second{instance=~"$instance"}[30m]) * 0.5 by (job)'
    assert metric_identifiers(expr) == {"seektrain_tokens_per_second"}
    assert metric_identifiers("label_values(seektrain_step, instance)") == {"seektrain_step", "instance"}


def test_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 15
    used = set()
    for expr in exprs:
        if expr.startswith("label_values("):  # label_values(metric, label): only the metric counts
            expr = expr[len("label_values(") :].split(",")[0]
        used |= metric_identifiers(expr)
    assert used, exprs
    assert used <= EXPORTED_METRICS, sorted(used - EXPORTED_METRICS)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "loss",
        "learning rate",
        "gradient norm",
        "throughput",
        "mfu",
        "loss scale",
        "step time",
        "memory",
        "expert imbalance",
        "moe expert load per layer",
        "router entropy per layer",
        "gpu utilisation",
    ):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_alert_rules_query_only_exported_metrics():
    # PyYAML is no dependency, and the expressions are one line each: scan the text.
    exprs = re.findall(r"^\s*expr:\s*(.+)$", ALERTS.read_text(), flags=re.M)
    assert len(exprs) >= 3
    used = set().union(*(metric_identifiers(e) for e in exprs))
    assert {
        "seektrain_step",
        "seektrain_loss",
        "seektrain_tokens_per_second",
        "seektrain_moe_load_max_over_mean",
    } <= used
    assert used <= EXPORTED_METRICS | PROMETHEUS_BUILTIN, sorted(used - EXPORTED_METRICS)


def test_docs_list_every_exported_metric():
    docs = (ROOT / "docs" / "observability.md").read_text()
    missing = [name for name in EXPORTED_METRICS if f"`{name}`" not in docs]
    assert not missing, missing
