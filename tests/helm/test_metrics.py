"""Every metric the Grafana dashboard and the alert rules query is one kvcompd exports: the names
come from service/include/kvcomp/service/metric_names.h (the daemon's single list), the queries
are parsed with a real PromQL parser (promql-parser), and label names are checked too."""
import json
import os
import re

import promql_parser as promql
import pytest

from conftest import CHART, REPO, by_kind, documents, render


METRIC_NAMES_H = os.path.join(REPO, "service", "include", "kvcomp", "service", "metric_names.h")
# Labels Prometheus attaches to every scraped series (target labels of a ServiceMonitor or
# PodMonitor) and the histogram bucket label.
TARGET_LABELS = {"namespace", "pod", "job", "instance", "container", "service", "endpoint", "node",
                 "le"}
# Grafana variables, replaced by values of the right type before parsing.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                "${datasource}": "prom", "$namespace": ".*", "$pod": ".*"}


def label_values():
    """{label: allowed values} from metric_names.h's comments: `{tier} = device | host | ...`,
    and the status codes listed for `code`."""
    with open(METRIC_NAMES_H) as f:
        text = f.read()
    values = {}
    for label, alternatives in re.findall(r"\{(\w+)\} = ([a-z_]+(?: \| [a-z_]+)+)", text):
        values.setdefault(label, set()).update(alternatives.split(" | "))
    codes = re.search(r"code = the status code[^(]*\(([^)]*)\)", text.replace("\n//", ""))
    if codes:
        values["code"] = {c.strip() for c in codes.group(1).split(",") if c.strip() != "..."}
    return values


def exported():
    """{metric name: kind} from metric_names.h, kind 'histogram' or 'other'; and label names."""
    with open(METRIC_NAMES_H) as f:
        text = f.read()
    metrics, labels = {}, set()
    comment = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("//"):
            comment.append(s)
            continue
        m = re.search(r'inline constexpr char (k\w+)\[\] = "([a-z_:][a-z0-9_:]*)";\s*(//.*)?$', s)
        if m:
            ident, value, trailing = m.group(1), m.group(2), m.group(3) or ""
            if ident.startswith("kLabel"):
                labels.add(value)
            else:
                kind_text = " ".join(comment) + " " + trailing
                metrics[value] = "histogram" if "Histogram" in kind_text else "other"
        comment = []
    return metrics, labels


def selectors(expr, matched=None):
    """(metric names, label names) an expression uses; label matchers go to `matched` as
    (label, op, value)."""
    names, labels = [], set()

    def visit(node):
        if isinstance(node, promql.VectorSelector):
            if node.name:
                names.append(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    names.append(m.value)
                else:
                    labels.add(m.name)
                    if matched is not None:
                        matched.append((m.name, str(m.op), m.value))
        elif isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                labels.update(node.modifier.matching.labels)
            labels.update(node.modifier.group_labels or [])

    promql.walk(promql.parse(expr), visit)
    return names, labels


def substitute(expr):
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def dashboard_queries():
    with open(os.path.join(CHART, "dashboards", "kvcomp.json")) as f:
        dash = json.load(f)
    queries = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            queries.append((panel["title"], substitute(t["expr"])))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", var["query"]["query"])
            assert m, var["query"]
            queries.append((f"variable {var['name']}", substitute(m.group(1))))
    return queries


def alert_queries():
    values = {"metrics": {"prometheusRule": {"enabled": True}}}
    (rule,) = by_kind(documents(render(values)), "PrometheusRule")
    return [(r["alert"], r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def check(queries):
    metrics, metric_labels = exported()
    assert len(metrics) >= 20, f"parsed only {sorted(metrics)} from {METRIC_NAMES_H}"
    allowed_labels = metric_labels | TARGET_LABELS
    known_values = label_values()
    problems = []
    used = set()
    for where, expr in queries:
        matched = []
        try:
            names, labels = selectors(expr, matched)
        except Exception as e:  # a PromQL syntax error
            problems.append(f"{where}: cannot parse {expr!r}: {e}")
            continue
        assert names, f"{where}: no metric in {expr}"
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name in metrics:
                used.add(name)
            elif base != name and metrics.get(base) == "histogram":
                used.add(base)
            else:
                problems.append(f"{where}: {name} is not exported by kvcompd")
        for label in labels - allowed_labels:
            problems.append(f"{where}: label {label} is neither a kvcomp label nor a target label")
        for label, op, value in matched:
            if label not in known_values or value == ".*":
                continue
            # Equality, or a regex of plain alternatives (code!~"busy|not_found").
            words = [value] if op.endswith("Equal") else value.split("|")
            if all(re.fullmatch(r"[a-z_]+", w) for w in words):
                for w in words:
                    if w not in known_values[label]:
                        problems.append(f"{where}: {label}={w!r} is not a value kvcompd exports "
                                        f"(metric_names.h: {sorted(known_values[label])})")
    assert not problems, "\n".join(problems)
    return used


def test_metric_names_header_parses():
    metrics, labels = exported()
    for name in ("kvcomp_resident_saved_bytes", "kvcomp_compression_ratio",
                 "kvcomp_stage_duration_seconds", "kvcomp_queue_depth", "kvcomp_errors_total",
                 "kvcomp_tier_stored_bytes", "kvcomp_cache_requests_total"):
        assert name in metrics
    assert metrics["kvcomp_stage_duration_seconds"] == "histogram"
    assert metrics["kvcomp_resident_saved_bytes"] == "other"
    assert {"tier", "stage", "op", "code"} <= labels
    values = label_values()
    assert values["tier"] >= {"device", "host"} and values["stage"] >= {"compress", "serve"}
    assert {"busy", "not_found", "data_loss"} <= values["code"]
    assert {"hit", "partial", "miss"} <= values["result"]
    assert {"prefix_lookup", "chunk_get", "transport"} <= values["op"]


def test_no_name_is_both_a_counter_family_and_another_metric():
    """OpenMetrics names a counter's family without `_total`: a gauge of that name clashes
    (prometheus_client refuses to register both)."""
    metrics, _ = exported()
    for name in metrics:
        if name.endswith("_total"):
            assert name[:-len("_total")] not in metrics, f"{name} clashes with a gauge"


def test_dashboard_uses_only_exported_metrics():
    used = check(dashboard_queries())
    # The dashboard shows what the issue asks for.
    for name in ("kvcomp_resident_saved_bytes", "kvcomp_resident_original_bytes",
                 "kvcomp_cache_requests_total", "kvcomp_prefix_keys_total",
                 "kvcomp_saved_bytes_total", "kvcomp_compression_ratio",
                 "kvcomp_tier_stored_bytes", "kvcomp_tier_capacity_bytes",
                 "kvcomp_received_bytes_total", "kvcomp_served_bytes_total",
                 "kvcomp_stage_duration_seconds", "kvcomp_errors_total", "kvcomp_queue_depth"):
        assert name in used, f"the dashboard does not show {name}"


def test_alert_rules_use_only_exported_metrics():
    queries = alert_queries()
    assert len(queries) >= 10
    check(queries)


def test_checker_catches_unknown_names():
    with pytest.raises(AssertionError, match="kvcomp_made_up_total is not exported"):
        check([("test", "rate(kvcomp_made_up_total[5m])")])
    with pytest.raises(AssertionError, match="kvcomp_saved_bytes_bucket is not exported"):
        check([("test", "kvcomp_saved_bytes_bucket")])  # not a histogram
    with pytest.raises(AssertionError, match="label shard"):
        check([("test", "sum by (shard) (kvcomp_queue_depth)")])
    with pytest.raises(AssertionError, match="tier='disk' is not a value"):
        check([("test", 'kvcomp_tier_entries{tier="disk"}')])
    with pytest.raises(AssertionError, match="code='dataloss' is not a value"):
        check([("test", 'kvcomp_errors_total{code=~"busy|dataloss"}')])
    with pytest.raises(AssertionError, match="cannot parse"):
        check([("test", "sum(kvcomp_queue_depth")])


def test_operations_doc_explains_every_metric_and_alert():
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        ops = f.read()
    metrics, _ = exported()
    missing = [m for m in metrics if f"`{m}`" not in ops and f"`{m}{{" not in ops]
    assert not missing, f"docs/operations.md does not explain {missing}"
    missing = [a for a, _ in alert_queries() if f"`{a}`" not in ops]
    assert not missing, f"docs/operations.md does not explain {missing}"
