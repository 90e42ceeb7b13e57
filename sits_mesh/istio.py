"""Istio output for the same mesh policy: `EnvoyFilter` resources and a `DestinationRule`.

Pure. The Envoy pieces are the very dicts envoy_config.py renders, so the
sidecar and the standalone Envoy enforce the same limits:
- HTTP filters (local rate limit, admission ext_proc) inserted before the router
  on the engine's inbound listener;
- connection-manager and cluster patches for HTTP/2 windows, buffers and the
  stream idle timeout;
- the admission processor's cluster;
- a bootstrap patch with the overload manager and the layered runtime (admin
  layer), so the executor can move breakers through the sidecar's admin API.
"""

from __future__ import annotations

from typing import Any

import yaml

from sits_mesh.envoy_config import (
    EXT_PROC_FILTER,
    HTTP_OPTIONS_KEY,
    HTTP_OPTIONS_TYPE,
    LOCAL_RATELIMIT_FILTER,
    duration,
    ext_proc_cluster,
    http2_options,
    http_filters,
    local_reply_config,
    overload_manager,
    runtime_defaults,
)
from sits_mesh.policy import PRIORITY_NAMES, MeshPolicy

ENVOY_FILTER_API = "networking.istio.io/v1alpha3"
DESTINATION_RULE_API = "networking.istio.io/v1"
_ROUTER = "envoy.filters.http.router"
_HCM = "envoy.filters.network.http_connection_manager"


def _metadata(policy: MeshPolicy, suffix: str) -> dict[str, Any]:
    return {
        "name": f"{policy.name}-{suffix}",
        "namespace": policy.namespace,
        "labels": {"app.kubernetes.io/managed-by": "sits", "sits.io/policy-version": str(policy.version)},
    }


def _inbound_listener(policy: MeshPolicy) -> dict[str, Any]:
    return {"context": "SIDECAR_INBOUND", "listener": {"portNumber": policy.upstream.port}}


def _manager_patch(policy: MeshPolicy) -> dict[str, Any]:
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "http2_protocol_options": http2_options(policy),
        # Bounds a token stream (gRPC or SSE) that stopped moving.
        "stream_idle_timeout": duration(policy.timeouts.stream_idle_s),
    }
    if policy.engine_api == "openai":
        # The sidecar's own refusals (rate limit, overload, the processor's) in OpenAI's error format.
        manager["local_reply_config"] = local_reply_config(policy)
    return manager


def http_filters_envoy_filter(policy: MeshPolicy) -> dict[str, Any]:
    # A sidecar has no per-priority routes: the processor needs the headers (priority, path).
    with_headers = policy.model_copy(update={"admission": policy.admission.model_copy(update={"send_headers": True})})
    inserted = [f for f in http_filters(with_headers) if f["name"] in (LOCAL_RATELIMIT_FILTER, EXT_PROC_FILTER)]
    patches = [
        {
            "applyTo": "HTTP_FILTER",
            "match": {
                **_inbound_listener(policy),
                "listener": {
                    "portNumber": policy.upstream.port,
                    "filterChain": {"filter": {"name": _HCM, "subFilter": {"name": _ROUTER}}},
                },
            },
            "patch": {"operation": "INSERT_BEFORE", "value": http_filter},
        }
        for http_filter in inserted
    ]
    patches.append(
        {
            "applyTo": "NETWORK_FILTER",
            "match": {
                **_inbound_listener(policy),
                "listener": {"portNumber": policy.upstream.port, "filterChain": {"filter": {"name": _HCM}}},
            },
            "patch": {"operation": "MERGE", "value": {"name": _HCM, "typed_config": _manager_patch(policy)}},
        }
    )
    return {
        "apiVersion": ENVOY_FILTER_API,
        "kind": "EnvoyFilter",
        "metadata": _metadata(policy, "http-filters"),
        "spec": {"workloadSelector": {"labels": dict(policy.workload_labels)}, "configPatches": patches},
    }


def _engine_protocol(policy: MeshPolicy) -> dict[str, Any]:
    # vLLM's OpenAI server (uvicorn) speaks HTTP/1.1 only: the sidecar must not talk HTTP/2 to it.
    if policy.engine_api == "openai":
        return {"http_protocol_options": {}}
    return {"http2_protocol_options": http2_options(policy)}


def clusters_envoy_filter(policy: MeshPolicy) -> dict[str, Any]:
    window_patch = {
        "applyTo": "CLUSTER",
        "match": {"context": "SIDECAR_INBOUND", "cluster": {"portNumber": policy.upstream.port}},
        "patch": {
            "operation": "MERGE",
            "value": {
                "per_connection_buffer_limit_bytes": policy.http2.per_connection_buffer_limit_bytes,
                "typed_extension_protocol_options": {
                    HTTP_OPTIONS_KEY: {"@type": HTTP_OPTIONS_TYPE, "explicit_http_config": _engine_protocol(policy)}
                },
            },
        },
    }
    patches: list[dict[str, Any]] = [window_patch]
    if policy.admission.enabled:
        patches.append(
            {
                "applyTo": "CLUSTER",
                "match": {"context": "SIDECAR_INBOUND"},
                "patch": {"operation": "ADD", "value": ext_proc_cluster(policy)},
            }
        )
    patches.append(
        {
            "applyTo": "BOOTSTRAP",
            "patch": {
                "operation": "MERGE",
                "value": {
                    "overload_manager": overload_manager(policy),
                    "layered_runtime": {
                        "layers": [
                            {"name": "sits-static", "static_layer": runtime_defaults(policy)},
                            {"name": "admin", "admin_layer": {}},
                        ]
                    },
                },
            },
        }
    )
    return {
        "apiVersion": ENVOY_FILTER_API,
        "kind": "EnvoyFilter",
        "metadata": _metadata(policy, "clusters"),
        "spec": {"workloadSelector": {"labels": dict(policy.workload_labels)}, "configPatches": patches},
    }


def destination_rule(policy: MeshPolicy) -> dict[str, Any]:
    # The DestinationRule's pool is one pool for all priorities: it takes P0's
    # (largest) limits, and per-priority breaking stays in the EnvoyFilter runtime.
    p0 = policy.priorities.classes["p0"]
    max_requests = max(policy.priorities.classes[p].max_requests for p in PRIORITY_NAMES)
    outlier = policy.outlier_detection
    return {
        "apiVersion": DESTINATION_RULE_API,
        "kind": "DestinationRule",
        "metadata": _metadata(policy, "engine"),
        "spec": {
            "host": policy.service_host,
            "trafficPolicy": {
                "connectionPool": {
                    "tcp": {
                        "maxConnections": p0.max_connections,
                        "connectTimeout": duration(policy.timeouts.connect_s),
                    },
                    "http": {
                        "h2UpgradePolicy": "UPGRADE",
                        "http2MaxRequests": max_requests,
                        "http1MaxPendingRequests": p0.max_pending_requests,
                        "maxConcurrentStreams": policy.http2.max_concurrent_streams,
                        "idleTimeout": duration(policy.timeouts.stream_idle_s),
                    },
                },
                "outlierDetection": {
                    "consecutive5xxErrors": outlier.consecutive_5xx_errors,
                    "interval": duration(outlier.interval_s),
                    "baseEjectionTime": duration(outlier.base_ejection_time_s),
                    "maxEjectionPercent": outlier.max_ejection_percent,
                },
            },
        },
    }


def render_istio(policy: MeshPolicy) -> list[dict[str, Any]]:
    return [http_filters_envoy_filter(policy), clusters_envoy_filter(policy), destination_rule(policy)]


def render_istio_yaml(policy: MeshPolicy) -> str:
    return yaml.safe_dump_all(render_istio(policy), sort_keys=False, default_flow_style=False)
