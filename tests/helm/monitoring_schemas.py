"""JSON schemas for the Prometheus Operator kinds the chart renders (monitoring.coreos.com/v1).

kubernetes-validate ships the schemas of Kubernetes' own kinds only; these are written for this
repository from the Prometheus Operator API reference and cover the fields of ServiceMonitor,
PodMonitor and PrometheusRule that a chart commonly sets. They are strict (unknown fields are
errors), like the operator's CRDs with the API server's field validation.
"""

DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                       r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}

OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    "additionalProperties": False,
}

LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}

NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"},
                   "matchNames": {"type": "array", "items": {"type": "string"}}},
}

RELABEL_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": LABEL_NAME},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer", "minimum": 0},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod",
                            "HashMod", "labelmap", "LabelMap", "labeldrop", "LabelDrop",
                            "labelkeep", "LabelKeep", "lowercase", "Lowercase", "uppercase",
                            "Uppercase", "keepequal", "KeepEqual", "dropequal", "DropEqual"]},
    },
}

ENDPOINT_PROPS = {
    "port": {"type": "string"},
    "path": {"type": "string", "pattern": "^/"},
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": {"type": "boolean"},
    "honorTimestamps": {"type": "boolean"},
    "relabelings": {"type": "array", "items": RELABEL_CONFIG},
    "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
}


def _resource(kind, spec):
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": OBJECT_META,
            "spec": spec,
        },
    }


SERVICE_MONITOR = _resource("ServiceMonitor", {
    "type": "object",
    "required": ["selector", "endpoints"],
    "additionalProperties": False,
    "properties": {
        "jobLabel": {"type": "string"},
        "targetLabels": {"type": "array", "items": {"type": "string"}},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "selector": LABEL_SELECTOR,
        "namespaceSelector": NAMESPACE_SELECTOR,
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "properties": dict(ENDPOINT_PROPS, targetPort={"type": ["string", "integer"]})}},
    },
})

POD_MONITOR = _resource("PodMonitor", {
    "type": "object",
    "required": ["selector", "podMetricsEndpoints"],
    "additionalProperties": False,
    "properties": {
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "selector": LABEL_SELECTOR,
        "namespaceSelector": NAMESPACE_SELECTOR,
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "properties": ENDPOINT_PROPS}},
    },
})

RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "properties": {
        "alert": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": ["string", "integer"], "minLength": 1},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    "oneOf": [{"required": ["alert"], "not": {"required": ["record"]}},
              {"required": ["record"], "not": {"required": ["alert"]}}],
}

PROMETHEUS_RULE = _resource("PrometheusRule", {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "groups": {"type": "array", "items": {
            "type": "object", "required": ["name", "rules"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "minLength": 1},
                           "interval": DURATION,
                           "limit": {"type": "integer"},
                           "partial_response_strategy": {"type": "string"},
                           "rules": {"type": "array", "items": RULE}}}},
    },
})

SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
}
