"""Every dashboard query returns data when kvcompd's metrics exist: promtool evaluates each query
(Grafana variables replaced: all namespaces and pods, a 5m rate interval) as a recording rule over
synthetic series for every metric of metric_names.h from two daemons, and an `absent()` alert per
query proves it is not empty. This catches queries that parse but match nothing, such as a
division whose two sides carry different labels."""
import itertools
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import CHART
from test_metrics import exported, substitute

PODS = ["kvcomp-0", "kvcomp-1"]
# Label values of each metric, per metric_names.h.
DIMENSIONS = {
    "kvcomp_tier_": {"tier": ["device", "host", "rocksdb"]},
    "kvcomp_operation_duration_seconds": {"op": ["put", "get", "lookup", "delete"]},
    "kvcomp_stage_duration_seconds": {"stage": ["receive", "compress", "store", "serve"]},
    "kvcomp_errors_total": {"op": ["put", "get"], "code": ["busy", "invalid_argument"]},
    "kvcomp_auth_failures_total": {"plane": ["data", "control"]},
    "kvcomp_build_info": {"version": ["0.1.0"], "backend": ["cuda"]},
    "kvcomp_cache_requests_total": {"op": ["get", "prefix_lookup"],
                                    "result": ["hit", "partial", "miss"],
                                    "tenant": ["default"], "model_class": ["llama", "other"]},
    "kvcomp_prefix_keys_total": {"op": ["prefix_lookup", "chunk_get"],
                                 "result": ["held", "missing"],
                                 "tenant": ["default"], "model_class": ["llama"]},
}
BUCKETS = ["0.001", "0.01", "0.1", "1", "10", "+Inf"]


def label_sets(metric):
    dims = next((d for prefix, d in DIMENSIONS.items() if metric.startswith(prefix)), {})
    keys = sorted(dims)
    for pod in PODS:
        for combo in itertools.product(*(dims[k] for k in keys)):
            yield dict({"namespace": "serving", "job": "kvcomp", "pod": pod}, **dict(zip(keys, combo)))


def fmt(name, labels):
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def synthetic_series():
    metrics, _ = exported()
    out = []
    for metric, kind in metrics.items():
        for labels in label_sets(metric):
            if kind == "histogram":
                for i, le in enumerate(BUCKETS):
                    out.append({"series": fmt(f"{metric}_bucket", dict(labels, le=le)),
                                "values": f"0+{10 * (i + 1)}x40"})
                out.append({"series": fmt(f"{metric}_sum", labels), "values": "0+30x40"})
                out.append({"series": fmt(f"{metric}_count", labels), "values": "0+60x40"})
            elif metric.endswith("_total"):
                out.append({"series": fmt(metric, labels), "values": "0+1000x40"})
            elif metric == "kvcomp_resident_saved_bytes":
                out.append({"series": fmt(metric, labels), "values": "3000x40"})
            else:
                out.append({"series": fmt(metric, labels), "values": "4000x40"})
    return out


def dashboard_exprs():
    with open(os.path.join(CHART, "dashboards", "kvcomp.json")) as f:
        dash = json.load(f)
    exprs = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            exprs.append((f"{panel['title']} [{t['refId']}]", substitute(t["expr"])))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", var["query"]["query"])
            exprs.append((f"variable {var['name']}", substitute(m.group(1))))
    return exprs


def test_every_dashboard_query_returns_data(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: scripts/bootstrap.sh installs it")
    exprs = dashboard_exprs()
    rules, checks = [], []
    for i, (title, expr) in enumerate(exprs):
        rules.append({"record": f"kvcomp_dashboard_query_{i}", "expr": expr})
        rules.append({"alert": f"DashboardQuery{i}Empty",
                      "expr": f"absent(kvcomp_dashboard_query_{i})",
                      "annotations": {"summary": title}})
        checks.append({"eval_time": "30m", "alertname": f"DashboardQuery{i}Empty",
                       "exp_alerts": []})
    (tmp_path / "dashboard_rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    (tmp_path / "dashboard_test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["dashboard_rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": synthetic_series(),
                   "alert_rule_test": checks}]}))
    r = subprocess.run([promtool, "test", "rules", "dashboard_test.yaml"], cwd=tmp_path,
                       capture_output=True, text=True)
    failed = sorted(set(re.findall(r"summary=\"([^\"]+)\"", r.stdout)))
    assert r.returncode == 0, "queries returning nothing:\n  " + "\n  ".join(failed) + "\n" + \
        r.stdout[-3000:] + r.stderr[-2000:]


def test_empty_query_is_detected(tmp_path):
    """The check above fails for a query that matches nothing."""
    rules = [{"record": "kvcomp_dashboard_query_0",
              "expr": 'sum by (tier) (kvcomp_tier_stored_bytes) / sum by (pod) '
                      '(kvcomp_tier_capacity_bytes)'},
             {"alert": "DashboardQuery0Empty", "expr": "absent(kvcomp_dashboard_query_0)"}]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]}))
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({
        "rule_files": ["r.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": synthetic_series(),
                   "alert_rule_test": [{"eval_time": "30m", "alertname": "DashboardQuery0Empty",
                                        "exp_alerts": []}]}]}))
    r = subprocess.run([shutil.which("promtool") or "promtool", "test", "rules", "t.yaml"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
