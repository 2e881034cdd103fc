"""What the chart tells client pods: KVCOMP_ENDPOINTS from the kvcomp.client.env template, a DNS
pool of the headless Service in daemonset and statefulset modes, localhost in sidecar mode."""
import shutil

import pytest
import yaml

from conftest import CHART, NAMESPACE, RELEASE, documents, example_chart, one, render

CONSUMER_CHART = """apiVersion: v2
name: consumer
version: 0.1.0
dependencies:
  - name: kvcomp
    version: 0.1.0
    repository: file://../kvcomp
"""

CONSUMER_TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: client-env
data:
  env: |
    {{- include "kvcomp.client.env" .Subcharts.kvcomp | nindent 4 }}
"""


def client_env(tmp_path, kvcomp_values):
    """The env entries an inference chart gets from kvcomp.client.env."""
    chart = tmp_path / "consumer"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(CONSUMER_CHART)
    (chart / "templates" / "client-env.yaml").write_text(CONSUMER_TEMPLATE)
    shutil.copytree(CHART, chart / "charts" / "kvcomp")
    docs = documents(render({"kvcomp": kvcomp_values}, chart=str(chart)))
    cm = [d for _, d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "client-env"]
    assert len(cm) == 1
    return {e["name"]: e["value"] for e in yaml.safe_load(cm[0]["data"]["env"])}


@pytest.mark.parametrize("mode", ["daemonset", "statefulset"])
def test_pool_modes_give_the_headless_service_as_a_dns_pool(tmp_path, mode):
    env = client_env(tmp_path, {"mode": mode, "ports": {"ucx": 7500, "thrift": 7501}})
    service = f"{RELEASE}-kvcomp"
    assert env == {"KVCOMP_ENDPOINTS": f"dns:///{service}.{NAMESPACE}.svc:7500,7501"}
    # The name is the headless Service the chart renders, on the same ports.
    docs = documents(render({"mode": mode, "ports": {"ucx": 7500, "thrift": 7501}}))
    svc = one(docs, "Service")
    assert svc["metadata"]["name"] == service and svc["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["ucx"] == 7500


def test_sidecar_keeps_localhost(tmp_path):
    env = client_env(tmp_path, {"mode": "sidecar"})
    assert env == {"KVCOMP_ENDPOINTS": "127.0.0.1:7470,127.0.0.1:7471"}
    # The example inference chart passes it to its engine container.
    docs = documents(render(chart=example_chart(tmp_path / "example")))
    engine = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    values = {e["name"]: e.get("value") for e in engine["env"]}
    assert values["KVCOMP_ENDPOINTS"] == "127.0.0.1:7470,127.0.0.1:7471"


def test_explicit_endpoints_win(tmp_path):
    env = client_env(tmp_path, {"mode": "statefulset",
                                "clients": {"endpoints": "dns:///kv.example:7470,7471"}})
    assert env == {"KVCOMP_ENDPOINTS": "dns:///kv.example:7470,7471"}


def test_no_service_and_no_endpoints_is_refused(tmp_path):
    with pytest.raises(Exception, match="clients.endpoints"):
        client_env(tmp_path, {"mode": "statefulset", "service": {"enabled": False}})
