"""Shared helpers of the chart tests: render helm/kvcomp with Helm's own engine and load the result.

Rendering goes through helm-python-sdk (import name helm_python), a ctypes binding of libhelm_c,
which is Helm v4's Go SDK built as a C library: the same template engine, Sprig functions,
values coalescing and values.schema.json validation as `helm template`.
"""
import glob
import os
import re
import shutil

import pytest
import yaml

import helm_python as helm  # helm-python-sdk, installed by scripts/bootstrap.sh

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHART = os.path.join(REPO, "helm", "kvcomp")
EXAMPLE = os.path.join(REPO, "helm", "examples", "inference-sidecar")
VALUES_DIR = os.path.join(os.path.dirname(__file__), "values")
VALUES_FILES = sorted(glob.glob(os.path.join(VALUES_DIR, "*.yaml")))
RELEASE = "kvtest"
NAMESPACE = "serving"


def load_values(path):
    with open(path) as f:
        return yaml.safe_load(f) or {}


def render(values=None, chart=CHART, name=RELEASE, namespace=NAMESPACE):
    """Renders a chart; returns {template path: rendered text} like `helm template`."""
    with helm.Chart.load(chart) as c:
        return c.render(values or {}, name=name, namespace=namespace, is_install=True)


def documents(rendered):
    """The Kubernetes objects of a rendering, as (template path, object) pairs."""
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                docs.append((path, doc))
    return docs


def helm_template_output(rendered):
    """The rendering as one stream, the way `helm template` prints it."""
    parts = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        parts.append(f"---\n# Source: {path}\n{text.strip()}\n")
    return "".join(parts)


def by_kind(docs, kind):
    return [d for _, d in docs if d.get("kind") == kind]


def one(docs, kind):
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def example_chart(tmp_path):
    """A copy of the sidecar example with helm/kvcomp vendored into its charts/ (what
    `helm dependency update` does for the file:// dependency)."""
    dst = tmp_path / "inference-sidecar"
    shutil.copytree(EXAMPLE, dst)
    shutil.copytree(CHART, dst / "charts" / "kvcomp")
    return str(dst)


def config_keys_from_docs():
    """{key: (type, description)} from the tables of docs/configuration.md."""
    keys = {}
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        for line in f:
            m = re.match(r"^\| `([a-z_]+\.[a-z_]+)` \| (\w+) \| `([^`]*)` \| `\w+` \| (.*) \|$",
                         line.strip())
            if m:
                keys[m.group(1)] = (m.group(2), m.group(4))
    return keys


@pytest.fixture(scope="session")
def chart_values():
    return load_values(os.path.join(CHART, "values.yaml"))
