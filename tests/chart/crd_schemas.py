"""Structural JSON Schemas of the custom resources the chart renders.

kubernetes-validate knows only the built-in kinds, so the Prometheus Operator's
ServiceMonitor and PrometheusRule and KEDA's ScaledObject and TriggerAuthentication are
checked against these instead. They are written by hand from the CRDs' documented fields
and cover the fields the chart uses, strictly (unknown fields are errors), not the whole
CRDs: a field the chart starts using must be added here, on purpose.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

STRING: Schema = {"type": "string", "minLength": 1}
STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
DURATION: Schema = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}


def strict(properties: Schema, required: list[str]) -> Schema:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": required,
    }


METADATA: Schema = strict(
    {"name": STRING, "namespace": STRING, "labels": STRING_MAP, "annotations": STRING_MAP},
    ["name"],
)
LABEL_SELECTOR: Schema = strict({"matchLabels": STRING_MAP}, ["matchLabels"])


def resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return strict(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    strict(
        {
            "selector": LABEL_SELECTOR,
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "port": STRING,
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": DURATION,
                    },
                    ["port"],
                ),
            },
        },
        ["selector", "endpoints"],
    ),
)

RULE: Schema = {
    "oneOf": [
        strict(
            {
                "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "expr": STRING,
                "for": DURATION,
                "keep_firing_for": DURATION,
                "labels": STRING_MAP,
                "annotations": STRING_MAP,
            },
            ["alert", "expr"],
        ),
        strict(
            {"record": STRING, "expr": STRING, "labels": STRING_MAP},
            ["record", "expr"],
        ),
    ]
}

PROMETHEUS_RULE = resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    strict(
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "name": STRING,
                        "interval": DURATION,
                        "rules": {"type": "array", "minItems": 1, "items": RULE},
                    },
                    ["name", "rules"],
                ),
            }
        },
        ["groups"],
    ),
)

HPA_POLICY: Schema = strict(
    {
        "type": {"enum": ["Pods", "Percent"]},
        "value": {"type": "integer", "minimum": 1},
        "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
    },
    ["type", "value", "periodSeconds"],
)
HPA_RULES: Schema = strict(
    {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "items": HPA_POLICY},
    },
    [],
)
STRING_VALUES: Schema = {"type": "object", "additionalProperties": {"type": "string"}}

SCALED_OBJECT = resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    strict(
        {
            "scaleTargetRef": strict(
                {
                    "apiVersion": STRING,
                    "kind": {"enum": ["Deployment", "StatefulSet"]},
                    "name": STRING,
                },
                ["name"],
            ),
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "advanced": strict(
                {
                    "horizontalPodAutoscalerConfig": strict(
                        {"behavior": strict({"scaleUp": HPA_RULES, "scaleDown": HPA_RULES}, [])},
                        [],
                    )
                },
                [],
            ),
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "type": {"enum": ["redis", "redis-sentinel", "prometheus"]},
                        # KEDA reads every trigger parameter as a string.
                        "metadata": STRING_VALUES,
                        "authenticationRef": strict({"name": STRING}, ["name"]),
                    },
                    ["type", "metadata"],
                ),
            },
        },
        ["scaleTargetRef", "triggers"],
    ),
)

TRIGGER_AUTHENTICATION = resource(
    "keda.sh/v1alpha1",
    "TriggerAuthentication",
    strict(
        {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {"parameter": STRING, "name": STRING, "key": STRING},
                    ["parameter", "name", "key"],
                ),
            }
        },
        ["secretTargetRef"],
    ),
)

# Parameters each KEDA trigger type requires (KEDA's scaler docs).
TRIGGER_REQUIRED: dict[str, set[str]] = {
    "redis": {"address", "listName", "listLength"},
    "redis-sentinel": {"addresses", "sentinelMaster", "listName", "listLength"},
    "prometheus": {"serverAddress", "query", "threshold"},
}

BY_KIND: dict[str, Schema] = {
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
    "ScaledObject": SCALED_OBJECT,
    "TriggerAuthentication": TRIGGER_AUTHENTICATION,
}
