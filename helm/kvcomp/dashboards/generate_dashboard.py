#!/usr/bin/env python3
"""Writes the kvcomp Grafana dashboard, dashboards/kvcomp.json, which the chart ships.

The JSON is generated so that panels stay uniform; the generated file is committed, and
tests/helm checks that it is up to date and that every metric it queries is one kvcompd exports.
Run: python3 helm/kvcomp/dashboards/generate_dashboard.py
"""
import json
import os

SEL = 'namespace=~"$namespace", pod=~"$pod"'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self):
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1
        self.panels = []

    def _id(self):
        self.next_id += 1
        return self.next_id - 1

    def row(self, title):
        self.newline()
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def newline(self):
        if self.x:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0

    def add(self, panel, w, h):
        if self.x + w > 24:
            self.newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr, legend="", ref="A", instant=False):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
        t["format"] = "table"
    return t


def targets(*pairs):
    return [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(pairs)]


def stat(title, description, expr, unit, decimals=None):
    p = {"type": "stat", "title": title, "description": description, "datasource": DS,
         "targets": [target(expr)],
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "value", "graphMode": "area", "textMode": "auto"}}
    if decimals is not None:
        p["fieldConfig"]["defaults"]["decimals"] = decimals
    return p


def timeseries(title, description, tgts, unit, stack=False):
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "targets": tgts,
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def quantile(q, metric, by):
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate({metric}_bucket{{{SEL}}}[{RATE}])))")


def build():
    L = Layout()
    original = f"sum(kvcomp_resident_original_bytes{{{SEL}}})"
    saved = f"sum(kvcomp_resident_saved_bytes{{{SEL}}})"

    L.row("Memory saved")
    L.add(stat("Memory saved", "Original minus stored bytes of the caches stored now "
               "(kvcomp_resident_saved_bytes).", saved, "bytes"), 6, 5)
    L.add(stat("Compression ratio", "Original over stored bytes of the caches stored now.",
               f"{original} / clamp_min({original} - {saved}, 1)", "none", 2), 6, 5)
    L.add(stat("Caches stored", "Caches held in all tiers (kvcomp_caches_stored).",
               f"sum(kvcomp_caches_stored{{{SEL}}})", "short"), 6, 5)
    L.add(stat("Daemons ready", "Daemons taking new work (kvcomp_ready).",
               f"sum(kvcomp_ready{{{SEL}}})", "short"), 6, 5)
    L.add(timeseries(
        "Original against stored bytes", "Uncompressed size of the caches stored now, what "
        "they take in the store, and the difference: the memory saved.",
        targets((original, "original"), (f"{original} - {saved}", "stored"),
                (saved, "saved")), "bytes"), 12, 8)
    L.add(timeseries(
        "Bytes compressed per second", "Rates of the counters: uncompressed bytes of the "
        "caches stored, compressed bytes written, and their difference.",
        targets((f"sum(rate(kvcomp_original_bytes_total{{{SEL}}}[{RATE}]))", "original"),
                (f"sum(rate(kvcomp_stored_bytes_total{{{SEL}}}[{RATE}]))", "stored"),
                (f"sum(rate(kvcomp_saved_bytes_total{{{SEL}}}[{RATE}]))", "saved")),
        "Bps"), 12, 8)
    L.add(timeseries(
        "Compression ratio of the caches stored", "Percentiles and mean of the per-cache "
        "ratio (kvcomp_compression_ratio histogram) over the caches stored in the interval.",
        targets((quantile(0.1, "kvcomp_compression_ratio", "namespace"), "p10"),
                (quantile(0.5, "kvcomp_compression_ratio", "namespace"), "p50"),
                (quantile(0.9, "kvcomp_compression_ratio", "namespace"), "p90"),
                (f"sum(rate(kvcomp_compression_ratio_sum{{{SEL}}}[{RATE}])) / "
                 f"sum(rate(kvcomp_compression_ratio_count{{{SEL}}}[{RATE}]))", "mean")),
        "none"), 12, 8)
    L.add(timeseries(
        "Memory saved per daemon", "kvcomp_resident_saved_bytes by pod.",
        targets((f"sum by (pod) (kvcomp_resident_saved_bytes{{{SEL}}})", "{{pod}}")), "bytes"),
        12, 8)

    reads = f"kvcomp_cache_requests_total{{{SEL}}}"
    hits = f'kvcomp_cache_requests_total{{{SEL}, result="hit"}}'
    L.row("Hits and misses")
    L.add(stat("Hit rate", "Reads that found every key asked for, over all reads (gets, "
               "lookups, prefix lookups, chunk gets; kvcomp_cache_requests_total).",
               f"sum(rate({hits}[{RATE}])) / clamp_min(sum(rate({reads}[{RATE}])), 1e-9)",
               "percentunit", 2), 6, 5)
    L.add(stat("Prefix keys held", "Keys of prefix lookups and chunk gets that were held, over "
               "all keys asked for (kvcomp_prefix_keys_total).",
               f'sum(rate(kvcomp_prefix_keys_total{{{SEL}, result="held"}}[{RATE}])) / '
               f"clamp_min(sum(rate(kvcomp_prefix_keys_total{{{SEL}}}[{RATE}])), 1e-9)",
               "percentunit", 2), 6, 5)
    L.add(stat("Bytes saved in the range", "Original minus stored bytes of the caches stored "
               "during the dashboard's time range (kvcomp_saved_bytes_total).",
               f"sum(increase(kvcomp_saved_bytes_total{{{SEL}}}[$__range]))", "bytes"), 6, 5)
    L.add(stat("Bytes served", "Cache bytes sent to clients during the time range "
               "(kvcomp_served_bytes_total).",
               f"sum(increase(kvcomp_served_bytes_total{{{SEL}}}[$__range]))", "bytes"), 6, 5)
    L.add(timeseries(
        "Hit rate by operation", "Hits over reads per operation: get, lookup (data plane), "
        "prefix_lookup and chunk_get (control plane).",
        targets((f"sum by (op) (rate({hits}[{RATE}])) / "
                 f"clamp_min(sum by (op) (rate({reads}[{RATE}])), 1e-9)", "{{op}}")),
        "percentunit"), 12, 8)
    L.add(timeseries(
        "Hits, partial hits and misses", "Reads per second by outcome.",
        targets((f"sum by (result) (rate({reads}[{RATE}]))", "{{result}}")), "reqps",
        stack=True), 12, 8)
    L.add(timeseries(
        "Hit rate by tenant and model class", "Hits over reads per tenant and model class "
        "(bounded labels: values past the daemon's limit read \"other\").",
        targets((f"sum by (tenant, model_class) (rate({hits}[{RATE}])) / "
                 f"clamp_min(sum by (tenant, model_class) (rate({reads}[{RATE}])), 1e-9)",
                 "{{tenant}} {{model_class}}")), "percentunit"), 12, 8)
    L.add(timeseries(
        "Bytes saved per second", "Original minus stored bytes of the caches stored, per "
        "second (kvcomp_saved_bytes_total).",
        targets((f"sum(rate(kvcomp_saved_bytes_total{{{SEL}}}[{RATE}]))", "saved")), "Bps"),
        12, 8)

    L.row("Tiers")
    L.add(timeseries(
        "Tier occupancy", "Stored bytes over capacity per tier (device, host, rocksdb).",
        targets((f"sum by (tier) (kvcomp_tier_stored_bytes{{{SEL}}}) / "
                 f"sum by (tier) (kvcomp_tier_capacity_bytes{{{SEL}}} > 0)", "{{tier}}")),
        "percentunit"), 8, 8)
    L.add(timeseries(
        "Tier bytes and capacity", "Stored bytes and capacity per tier.",
        targets((f"sum by (tier) (kvcomp_tier_stored_bytes{{{SEL}}})", "{{tier}} stored"),
                (f"sum by (tier) (kvcomp_tier_capacity_bytes{{{SEL}}})", "{{tier}} capacity")),
        "bytes"), 8, 8)
    L.add(timeseries(
        "Tier entries", "Caches held per tier.",
        targets((f"sum by (tier) (kvcomp_tier_entries{{{SEL}}})", "{{tier}}")), "short"), 8, 8)
    L.add(timeseries(
        "Demotions and evictions", "Entries moved down a tier, and entries evicted (dropped "
        "from the store for lack of room), per second.",
        targets((f"sum by (tier) (rate(kvcomp_tier_demotions_total{{{SEL}}}[{RATE}]))",
                 "{{tier}} demoted"),
                (f"sum by (tier) (rate(kvcomp_tier_evictions_total{{{SEL}}}[{RATE}]))",
                 "{{tier}} evicted")), "ops"), 24, 8)
    L.add(timeseries(
        "RocksDB disk free", "Free bytes of each daemon's RocksDB volume, and the reserve a put "
        "must leave (tiers.rocksdb.reserve): below it puts are refused as disk full.",
        targets((f"sum by (pod) (kvcomp_disk_free_bytes{{{SEL}}})", "{{pod}} free"),
                (f"sum by (pod) (kvcomp_disk_reserve_bytes{{{SEL}}})", "{{pod}} reserve")),
        "bytes"), 18, 8)
    L.add(stat("Read-only stores", "Daemons whose RocksDB tier is read-only for a full disk "
               "(kvcomp_store_read_only): reads served, puts refused until there is room.",
               f"sum(kvcomp_store_read_only{{{SEL}}})", "short"), 6, 8)
    L.add(timeseries(
        "Store damage", "Caches found damaged and quarantined, never served "
        "(kvcomp_store_quarantined_total: a checksum that failed or bytes that could not be read, "
        "at start, on a read, in the check of recovered caches or a repair pass), damaged data "
        "RocksDB met in a compaction, skipped in a write-ahead log, or a damaged table file or "
        "MANIFEST tail met at start (kvcomp_store_corruptions_total) and repair passes, "
        "per daemon, in each interval. Any of them: check the node's disk; the daemon's log "
        "names the caches.",
        targets((f"sum by (pod) (increase(kvcomp_store_quarantined_total{{{SEL}}}[{RATE}]))",
                 "{{pod}} quarantined"),
                (f"sum by (pod) (increase(kvcomp_store_corruptions_total{{{SEL}}}[{RATE}]))",
                 "{{pod}} damaged (compaction or log)"),
                (f"sum by (pod) (increase(kvcomp_store_repairs_total{{{SEL}}}[{RATE}]))",
                 "{{pod}} repair passes")), "short"), 24, 8)

    L.row("Throughput")
    L.add(timeseries(
        "Ingest and serve throughput", "K and V bytes received from prefill nodes, and bytes "
        "served to decode nodes.",
        targets((f"sum(rate(kvcomp_received_bytes_total{{{SEL}}}[{RATE}]))", "ingest"),
                (f"sum(rate(kvcomp_served_bytes_total{{{SEL}}}[{RATE}]))", "serve")),
        "Bps"), 8, 8)
    L.add(timeseries(
        "Requests per second", "Completed requests per operation.",
        targets((f"sum by (op) (rate(kvcomp_operation_duration_seconds_count{{{SEL}}}"
                 f"[{RATE}]))", "{{op}}")), "reqps"), 8, 8)
    L.add(timeseries(
        "GPU time", "GPU-seconds spent compressing and decoding per second, per daemon "
        "(1 = one GPU busy all the time).",
        targets((f"sum by (pod) (rate(kvcomp_gpu_seconds_total{{{SEL}}}[{RATE}]))",
                 "{{pod}}")), "none"), 8, 8)

    L.row("Latency")
    for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        L.add(timeseries(
            f"Stage latency {name}", f"{name} of each pipeline stage (receive, compress, "
            "store, serve).",
            targets((quantile(q, "kvcomp_stage_duration_seconds", "stage"), "{{stage}}")),
            "s"), 8, 8)
    L.add(timeseries(
        "Operation latency p50 and p99", "End-to-end latency in the daemon per operation.",
        targets((quantile(0.5, "kvcomp_operation_duration_seconds", "op"), "{{op}} p50"),
                (quantile(0.99, "kvcomp_operation_duration_seconds", "op"), "{{op}} p99")),
        "s"), 24, 8)

    L.row("Errors and queue")
    L.add(timeseries(
        "Errors by operation and code", "Failed requests per second (kvcomp_errors_total).",
        targets((f"sum by (op, code) (rate(kvcomp_errors_total{{{SEL}}}[{RATE}]))",
                 "{{op}} {{code}}")), "reqps", stack=True), 8, 8)
    L.add(timeseries(
        "Authentication failures", "Requests refused for a missing or wrong token or another "
        "tenant's key, per plane.",
        targets((f"sum by (plane) (rate(kvcomp_auth_failures_total{{{SEL}}}[{RATE}]))",
                 "{{plane}}")), "reqps"), 8, 8)
    L.add(timeseries(
        "Queue depth", "Puts waiting or being compressed, and puts still receiving blocks.",
        targets((f"sum by (pod) (kvcomp_queue_depth{{{SEL}}})", "{{pod}} queued"),
                (f"sum by (pod) (kvcomp_puts_in_progress{{{SEL}}})", "{{pod}} receiving")),
        "short"), 8, 8)
    table = {"type": "table", "title": "Daemons", "description": "Version and backend of "
             "each daemon (kvcomp_build_info).", "datasource": DS,
             "targets": [target(f"max by (pod, version, backend) (kvcomp_build_info{{{SEL}}})",
                                instant=True)],
             "fieldConfig": {"defaults": {}, "overrides": []},
             "options": {"showHeader": True},
             "transformations": [{"id": "organize", "options": {
                 "excludeByName": {"Time": True, "Value": True}}}]}
    L.add(table, 24, 6)

    variables = [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": ""},
        {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DS,
         "query": {"query": "label_values(kvcomp_build_info, namespace)", "refId": "ns"},
         "definition": "label_values(kvcomp_build_info, namespace)",
         "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2,
         "sort": 1, "hide": 0, "regex": ""},
        {"name": "pod", "label": "Daemon", "type": "query", "datasource": DS,
         "query": {"query": 'label_values(kvcomp_build_info{namespace=~"$namespace"}, pod)',
                   "refId": "pod"},
         "definition": 'label_values(kvcomp_build_info{namespace=~"$namespace"}, pod)',
         "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2,
         "sort": 1, "hide": 0, "regex": ""},
    ]
    return {
        "uid": "kvcomp-overview",
        "title": "kvcomp",
        "description": "KV-cache compression: memory saved, tiers, throughput, latency, errors.",
        "tags": ["kvcomp"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": variables},
        "panels": L.panels,
    }


def render():
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvcomp.json")
    with open(out, "w") as f:
        f.write(render())
    print(out)
