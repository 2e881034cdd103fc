"""values.yaml and values.schema.json: the schema accepts the chart's values files and rejects bad
values (through Helm's own schema validation, as `helm install` does), the templates refuse
combinations the schema cannot express, and values.yaml documents every value."""
import json
import os
import re

import pytest

from conftest import CHART, VALUES_FILES, config_keys_from_docs, documents, helm, load_values, render

with open(os.path.join(CHART, "values.schema.json")) as _f:
    SCHEMA = json.load(_f)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


@pytest.mark.parametrize("path", VALUES_FILES, ids=os.path.basename)
def test_schema_accepts_values_files(chart, path):
    chart.validate_schema(load_values(path))


def test_schema_accepts_defaults(chart, chart_values):
    chart.validate_schema({})
    chart.validate_schema(chart_values)


BAD_VALUES = [
    ({"mode": "deployment"}, "/mode"),
    ({"unknownTopLevel": 1}, "unknownTopLevel"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"image": {"digest": "sha256:abc"}}, "/image/digest"),
    ({"image": {"repository": ""}}, "/image/repository"),
    ({"gpu": {"count": -1}}, "/gpu/count"),
    ({"gpu": {"count": "1"}}, "/gpu/count"),
    ({"tiers": {"host": {"capacity": "8GB"}}}, "/tiers/host/capacity"),
    ({"tiers": {"rocksdb": {"capacity": -5}}}, "/tiers/rocksdb/capacity"),
    ({"tiers": {"putTier": "disk"}}, "/tiers/putTier"),
    ({"tiers": {"highWatermark": 1.5}}, "/tiers/highWatermark"),
    ({"storage": {"durability": "durable"}}, "/storage/durability"),
    ({"persistence": {"type": "nfs"}}, "/persistence/type"),
    ({"persistence": {"mountPath": "relative/dir"}}, "/persistence/mountPath"),
    ({"ports": {"ucx": 0}}, "/ports/ucx"),
    ({"ports": {"thrift": 70000}}, "/ports/thrift"),
    ({"ucx": {"tls": "rc,sm"}}, "/ucx/tls"),
    ({"ucx": {"tcpPortRange": "20000"}}, "/ucx/tcpPortRange"),
    ({"ucx": {"extraEnv": {"LD_PRELOAD": "x"}}}, "LD_PRELOAD"),
    ({"policy": {"ratio": 1.0}}, "/policy/ratio"),
    ({"policy": {"recentFraction": 1.0}}, "/policy/recentFraction"),
    ({"policy": {"scorer": "h2o"}}, "/policy/scorer"),
    ({"policy": {"valueCodec": "int4"}}, "/policy/valueCodec"),
    ({"policy": {"groupSize": 0}}, "/policy/groupSize"),
    ({"policy": {"nsink": 4}}, "nsink"),
    ({"auth": {"tokens": {"team": "short"}}}, "/auth/tokens"),
    ({"auth": {"mode": "off"}}, "/auth/mode"),
    ({"auth": {"generatedTenant": "team a"}}, "/auth/generatedTenant"),
    ({"logLevel": "trace"}, "/logLevel"),
    ({"engine": {"workers": 0}}, "/engine/workers"),
    ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "/podDisruptionBudget/maxUnavailable"),
    ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"prometheusRule": {"thresholds": {"tierFullRatio": 2}}}},
     "/metrics/prometheusRule/thresholds/tierFullRatio"),
    ({"extraConfig": {"storge": {}}}, "storge"),
    ({"statefulset": {"replicas": 0}}, "/statefulset/replicas"),
    ({"nodeSelector": {"gpu": True}}, "/nodeSelector/gpu"),
]


@pytest.mark.parametrize("values,where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(chart, values, where):
    with pytest.raises(helm.HelmError) as e:
        chart.validate_schema(values)
    assert where in str(e.value)
    with pytest.raises(helm.HelmError):  # and an install would fail the same way
        chart.render(values, name="bad", namespace="serving")


BAD_COMBINATIONS = [
    ({"mode": "daemonset", "persistence": {"type": "pvc"}}, "persistence.type=pvc needs mode=statefulset"),
    ({"mode": "sidecar", "persistence": {"type": "pvc"}}, "persistence.type=pvc needs mode=statefulset"),
    ({"tiers": {"lowWatermark": 0.9, "highWatermark": 0.9}}, "lowWatermark must be below"),
    ({"thriftTls": {"enabled": True}}, "thriftTls.enabled needs thriftTls.secretName"),
    ({"auth": {"existingSecret": "s", "tokens": {"a": "0123456789abcdef0"}}}, "not both"),
    ({"auth": {"mode": "open", "tokens": {"a": "0123456789abcdef0"}}}, "auth.mode=open takes no"),
    ({"auth": {"mode": "open", "existingSecret": "s"}}, "auth.mode=open takes no"),
    ({"daemonset": {"hostPorts": True}, "hostNetwork": True}, "exclude each other"),
    ({"gpu": {"enabled": False}, "tiers": {"putTier": "device"}}, "putTier=device needs"),
    ({"tiers": {"rocksdb": {"enabled": False, "capacity": 0}}}, "durability=disk needs"),
    ({"shutdownGraceSeconds": 60, "terminationGracePeriodSeconds": 60}, "shutdownGraceSeconds must be below"),
    ({"extraEnv": [{"name": "KVCOMP_ENGINE_WORKERS", "value": "8"}]}, "would override the configuration"),
]


@pytest.mark.parametrize("values,message", BAD_COMBINATIONS, ids=[m for _, m in BAD_COMBINATIONS])
def test_templates_refuse_bad_combinations(chart, values, message):
    chart.validate_schema(values)  # each is fine field by field
    with pytest.raises(helm.HelmError) as e:
        chart.render(values, name="bad", namespace="serving")
    assert message in str(e.value)


def test_extra_config_sections_are_the_daemons():
    """extraConfig's allowed sections are exactly the daemon's top-level keys."""
    sections = {k.split(".")[0] for k in config_keys_from_docs()}
    assert sections, "docs/configuration.md lists no keys"
    assert set(SCHEMA["properties"]["extraConfig"]["propertyNames"]["enum"]) == sections


def test_every_schema_object_is_closed():
    """Every object the schema describes property by property rejects unknown keys, so a
    misspelt value fails instead of being ignored."""
    def walk(node, path):
        if isinstance(node, dict):
            if "properties" in node:
                assert node.get("additionalProperties") is False, f"{path} is open"
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
    walk(SCHEMA, "")


def test_every_value_is_documented():
    """Each leaf of values.yaml has a comment right above it, or sits under a key whose `# --`
    comment documents the whole block (e.g. resources, podSecurityContext)."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        lines = f.read().splitlines()
    undocumented = []
    stack = []  # (indent, key, documented_block)
    prev_comment = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            prev_comment = None
            continue
        if stripped.startswith("#"):
            if prev_comment is None:  # a comment block is judged by its first line
                prev_comment = stripped
            continue
        m = re.match(r"^( *)(- )?([A-Za-z0-9_.\-/]+):( .*)?$", line)
        if not m or m.group(2):
            prev_comment = None
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, rest = m.group(3), (m.group(4) or "").strip()
        covered = any(doc for _, _, doc in stack)
        has_comment = prev_comment is not None
        is_leaf = rest != ""
        block_doc = has_comment and prev_comment.startswith("# --")
        if is_leaf and not (has_comment or covered):
            path = ".".join([k for _, k, _ in stack] + [key])
            undocumented.append(f"line {i + 1}: {path}")
        stack.append((indent, key, block_doc and not is_leaf))
        prev_comment = None
    assert not undocumented, "undocumented values:\n" + "\n".join(undocumented)


def test_rendered_keys_are_daemon_keys():
    """The rendered configuration uses only keys of docs/configuration.md (an unknown key stops
    kvcompd at start). A documented key the chart does not model yet stays at the daemon's default
    and is reachable through extraConfig, whose sections are the daemon's."""
    import yaml
    docs = config_keys_from_docs()
    cms = [d for _, d in documents(render({})) if d["kind"] == "ConfigMap"]
    cfg = yaml.safe_load(cms[0]["data"]["kvcompd.yaml"])
    rendered = {f"{s}.{k}" for s, section in cfg.items() for k in section}
    assert rendered <= set(docs), f"keys kvcompd does not know: {sorted(rendered - set(docs))}"
    sections = set(SCHEMA["properties"]["extraConfig"]["propertyNames"]["enum"])
    for key in set(docs) - rendered:
        assert key.split(".")[0] in sections, f"{key} cannot be set through extraConfig"


def test_rendered_config_types_match_the_daemon_docs():
    import yaml
    docs = config_keys_from_docs()
    for path in VALUES_FILES:
        cms = [d for _, d in documents(render(load_values(path))) if d["kind"] == "ConfigMap"
               and d["metadata"]["name"].endswith("-config")]
        cfg = yaml.safe_load(cms[0]["data"]["kvcompd.yaml"])
        for section, body in cfg.items():
            for key, value in body.items():
                kind, description = docs[f"{section}.{key}"]
                where = f"{os.path.basename(path)}: {section}.{key}={value!r}"
                if kind in ("uint", "bytes"):
                    assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, where
                elif kind == "seconds":
                    assert isinstance(value, (int, float)) and value >= 0, where
                elif kind == "factor":
                    assert isinstance(value, (int, float)) and value >= 1, where
                elif kind == "fraction":
                    assert isinstance(value, (int, float)) and 0 <= value <= 1, where
                elif kind == "bool":
                    assert isinstance(value, bool), where
                elif kind == "string":
                    assert isinstance(value, str), where
                elif kind == "enum":
                    m = re.search(r"One of: ([a-z_, ]+)\.", description)
                    words = m.group(1).split(", ") if m else re.findall(r"[a-z_0-9]+", description)
                    assert value in words, where
                else:
                    pytest.fail(f"unknown type {kind} of {section}.{key}")
