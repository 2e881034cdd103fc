"""What a new user or integrator meets first, against a real kvcompd on loopback: hits, misses
and partial hits in the metrics (per tenant and model class; a miss is not an error), metric
names that pass OpenMetrics as well as the Prometheus text format (prometheus_client's parsers),
wrong ports that fail naming what answered, and lookups that return within their deadline from
a stopped (SIGSTOP) daemon."""

import os
import signal
import socket
import time

import numpy as np
import pytest

import kvcomp
from kvcompd_fixture import Kvcompd, built_kvcompd, sigstop

KVCOMPD = built_kvcompd()
pytestmark = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

MODEL = "test/first-hour"
LOSSLESS = dict(ratio=0.0, moments=False)


@pytest.fixture(scope="module")
def daemon():
    with Kvcompd(KVCOMPD) as d:
        yield d


def both(d):
    return f"{d.data_endpoint},127.0.0.1:{d.control_port}"


def kv(tokens=16, seed=0):
    rng = np.random.default_rng(seed)
    shape = (2, 2, tokens, 64)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)


def families(text):
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample_value(fams, family, name, **labels):
    total = 0.0
    for s in fams[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_hits_misses_and_partial_hits_are_counted_per_tenant_and_model(daemon):
    c = kvcomp.Client(both(daemon), timeout=30.0)
    k, v = kv()
    c.put(MODEL, b"whole", k, v, policy=kvcomp.Policy(**LOSSLESS))
    c.get(MODEL, b"whole")
    with pytest.raises(KeyError):
        c.get(MODEL, b"absent")
    keys = [b"c0", b"c1", b"c2", b"c3"]
    k4, v4 = kv(tokens=64, seed=1)
    c.put_chunks(MODEL, keys[:2], k4[:, :, :32], v4[:, :, :32], 16,
                 policy=kvcomp.Policy(**LOSSLESS))
    assert c.lookup_prefix(MODEL, keys) == 2          # partial
    assert c.lookup_prefix(MODEL, keys[:2]) == 2      # hit
    assert c.lookup_prefix(MODEL, [b"x0"]) == 0       # miss
    assert len(c.get_chunks(MODEL, keys)) == 2        # partial

    fams = families(daemon.http_get("/metrics")[1])
    reads = "kvcomp_cache_requests"
    lab = dict(tenant="default", model_class=MODEL)
    assert sample_value(fams, reads, reads + "_total", op="get", result="hit", **lab) >= 1
    assert sample_value(fams, reads, reads + "_total", op="get", result="miss", **lab) >= 1
    assert sample_value(fams, reads, reads + "_total", op="prefix_lookup", result="partial",
                        **lab) == 1
    assert sample_value(fams, reads, reads + "_total", op="prefix_lookup", result="hit",
                        **lab) == 1
    assert sample_value(fams, reads, reads + "_total", op="prefix_lookup", result="miss",
                        **lab) == 1
    assert sample_value(fams, reads, reads + "_total", op="chunk_get", result="partial",
                        **lab) == 1
    keys_fam = "kvcomp_prefix_keys"
    assert sample_value(fams, keys_fam, keys_fam + "_total", op="prefix_lookup",
                        result="held", **lab) == 4
    assert sample_value(fams, keys_fam, keys_fam + "_total", op="prefix_lookup",
                        result="missing", **lab) == 3
    # A miss is a miss, not an error.
    errors = fams.get("kvcomp_errors")
    if errors is not None:
        assert not [s for s in errors.samples
                    if s.labels.get("code") == "not_found" and s.labels.get("op") in
                    ("get", "lookup") and s.value > 0]


def test_model_class_label_is_bounded(daemon):
    c = kvcomp.Client(both(daemon), timeout=30.0)
    for i in range(40):
        assert c.lookup_prefix(f"bounded/m{i}", [b"k"]) == 0
    fams = families(daemon.http_get("/metrics")[1])
    classes = {s.labels["model_class"] for s in fams["kvcomp_cache_requests"].samples}
    assert "other" in classes
    assert len(classes) <= 32 + 1


def test_metric_names_pass_openmetrics(daemon):
    """The scrape parses as Prometheus text, and its families re-exposed as OpenMetrics through
    prometheus_client's registry (which refuses names that clash, e.g. a gauge named as a
    counter's family) parse back with the OpenMetrics parser."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    text = daemon.http_get("/metrics")[1]
    fams = list(families(text).values())
    names = [f.name for f in fams]
    assert len(names) == len(set(names)), "a family name appears twice"

    class Scraped:
        def collect(self):
            return fams

    registry = CollectorRegistry()
    registry.register(Scraped())  # ValueError on duplicated timeseries names
    om = generate_latest(registry).decode()
    parsed = {f.name for f in om_parse(om)}
    assert {"kvcomp_cache_requests", "kvcomp_resident_saved_bytes", "kvcomp_saved_bytes",
            "kvcomp_auth_failures", "kvcomp_compression_ratio"} <= parsed


def test_the_openmetrics_check_catches_a_gauge_named_as_a_counter_family():
    """What kvcompd exported before: a gauge kvcomp_saved_bytes beside the counter
    kvcomp_saved_bytes_total, one family name twice under OpenMetrics."""
    text = ("# TYPE kvcomp_saved_bytes_total counter\nkvcomp_saved_bytes_total 5\n"
            "# TYPE kvcomp_saved_bytes gauge\nkvcomp_saved_bytes 3\n")
    names = [f.name for f in families_list(text)]
    assert names.count("kvcomp_saved_bytes") == 2


def families_list(text):
    from prometheus_client.parser import text_string_to_metric_families
    return list(text_string_to_metric_families(text))


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_control_address_on_the_metrics_port_names_the_http_server(daemon):
    wrong = f"127.0.0.1:{daemon.metrics_port}"
    c = kvcomp.Client(f"{daemon.data_endpoint},{wrong}", connect=False)
    with pytest.raises(RuntimeError, match=f"{wrong}.*not a kvcompd control port.*HTTP"):
        c.lookup_prefix(MODEL, [b"k0"])
    with pytest.raises(RuntimeError, match="not a kvcompd control port"):
        c.get_chunks(MODEL, [b"k0"])


def test_control_address_where_nothing_listens_is_an_error(daemon):
    wrong = f"127.0.0.1:{_closed_port()}"
    c = kvcomp.Client(f"{daemon.data_endpoint},{wrong}", connect=False)
    with pytest.raises(ConnectionError, match=f"{wrong}.*connection refused"):
        c.lookup_prefix(MODEL, [b"k0"])


def test_data_address_on_the_control_port_names_the_thrift_service(daemon):
    wrong = f"127.0.0.1:{daemon.control_port}"
    c = kvcomp.Client(wrong, connect=False, connect_timeout=2.0)
    with pytest.raises(RuntimeError, match=f"{wrong}.*not a kvcompd data port.*Thrift"):
        c.get(MODEL, b"k0")
    with pytest.raises(RuntimeError, match="not a kvcompd data port"):
        kvcomp.Client(wrong, connect_timeout=2.0)


def test_lookup_returns_within_its_deadline_from_a_stopped_daemon():
    with Kvcompd(KVCOMPD) as d:
        c = kvcomp.Client(both(d), lookup_timeout=0.3, get_timeout=0.5, timeout=30.0)
        assert c.lookup_prefix(MODEL, [b"k0"]) == 0
        sigstop(d.proc)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="no endpoint answered"):
                c.lookup_prefix(MODEL, [b"k0", b"k1"])
            took = time.monotonic() - t0
            assert took < 2.0, took  # 0.3 s deadline; the request timeout is 30 s
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                c.get_chunks(MODEL, [b"k0"])
            assert time.monotonic() - t0 < 2.5
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert c.lookup_prefix(MODEL, [b"k0"]) == 0


def test_each_read_returns_within_its_own_timeout_from_a_stopped_daemon():
    """get, get_bytes, lookup, lookup_prefix and get_chunks take a per-call timeout: against a
    stopped daemon each raises TimeoutError within it, although the client's deadlines (and its
    request timeout) are 30 s; the connection answers again once the daemon runs."""
    with Kvcompd(KVCOMPD) as d:
        c = kvcomp.Client(both(d), lookup_timeout=30.0, get_timeout=30.0, timeout=30.0)
        with pytest.raises(KeyError):
            c.lookup(MODEL, b"k0")
        sigstop(d.proc)
        try:
            reads = {
                "get": lambda: c.get(MODEL, b"k0", timeout=0.3),
                "get decoded": lambda: c.get(MODEL, b"k0", decoded=True, timeout=0.3),
                "get_bytes": lambda: c.get_bytes(MODEL, b"k0", timeout=0.3),
                "lookup": lambda: c.lookup(MODEL, b"k0", timeout=0.3),
                "lookup_prefix": lambda: c.lookup_prefix(MODEL, [b"k0"], timeout=0.3),
                "get_chunks": lambda: c.get_chunks(MODEL, [b"k0"], timeout=0.3),
            }
            for name, read in reads.items():
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    read()
                took = time.monotonic() - t0
                assert took < 2.0, (name, took)
            with pytest.raises(ValueError, match="timeout"):
                c.get(MODEL, b"k0", timeout=0)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        with pytest.raises(KeyError):
            c.get(MODEL, b"k0", timeout=5.0)


def test_deadlines_must_be_positive(daemon):
    with pytest.raises(ValueError, match="lookup_timeout"):
        kvcomp.Client(both(daemon), lookup_timeout=0, connect=False)


def test_json_logs():
    import json
    import re
    with Kvcompd(KVCOMPD, flags=["--process.log_format=json"]) as d:
        kvcomp.Client(both(d)).lookup_prefix(MODEL, [b"k"])
        log = d.log()
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records, log
    assert all(r["logger"] == "kvcompd" and r["level"] in ("debug", "info", "warning", "error")
               and r["ts"].endswith("Z") and isinstance(r["msg"], str) for r in records)
    assert not re.search(r"^\d{4}-\d\d-\d\dT\S+Z [DIWE] kvcompd: ", log, re.M), log
