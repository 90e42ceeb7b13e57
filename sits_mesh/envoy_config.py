"""Render an Envoy bootstrap from the mesh policy.

Pure: the policy goes in, a dict (and its YAML text) comes out. Names that
other components depend on (runtime keys, cluster and stat names) are defined
here once and documented in mesh/README.md.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import yaml

from sits_mesh.policy import PRIORITY_NAMES, MeshPolicy, PriorityName, tier_cluster

INGRESS_STAT_PREFIX = "sits_ingress"
RATELIMIT_STAT_PREFIX = "sits_ratelimit"
ADMISSION_STAT_PREFIX = "sits_admission"
EXT_PROC_CLUSTER = "sits_ext_proc"
INJECTED_RESOURCE = "envoy.resource_monitors.injected_resource"
STOP_ACCEPTING_ACTION = "envoy.overload_actions.stop_accepting_requests"
DECODE_HEADERS_SHED_POINT = "envoy.load_shed_points.http_connection_manager_decode_headers"

# Runtime keys (admin layer: POST /runtime_modify?KEY=VALUE). Percent values.
RATELIMIT_ENABLED_KEY = "sits.ratelimit.enabled"
RATELIMIT_ENFORCED_KEY = "sits.ratelimit.enforced"
# 100 while the admission processor has found that no request could be refused
# (sits_mesh/bypass.py); Generate then skips it. Default 0: inspect.
ADMISSION_BYPASS_KEY = "sits.admission.bypass"
# Priorities that can be shed at the route by runtime; P0 is never shed there.
SHEDDABLE: tuple[PriorityName, ...] = ("p1", "p2")

_TYPE = "@type"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_LOCAL_RATELIMIT = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_BUFFER_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_INJECTED = "type.googleapis.com/envoy.extensions.resource_monitors.injected_resource.v3.InjectedResourceConfig"
HTTP_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
LOCAL_RATELIMIT_FILTER = "envoy.filters.http.local_ratelimit"
JSON_CHECK_FILTER = "envoy.filters.http.json_to_metadata"
BODY_RULES_FILTER = "envoy.filters.http.rbac"
HOLD_FILTER = "envoy.filters.http.buffer"
_JSON_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata"
_RBAC = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
_RBAC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBACPerRoute"
_FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
# Where Envoy's JSON check of a bypassed OpenAI body writes what it found (the model, or that it is no JSON).
BODY_METADATA = "sits.openai"
# As clients write them; json_to_metadata compares them exactly, so the RBAC check below does too.
JSON_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "application/json; charset=UTF-8")


def shed_key(priority: PriorityName) -> str:
    """Percent of this priority's new streams refused at the route (UNAVAILABLE)."""
    return f"sits.shed.{priority}"


def breaker_key(upstream_cluster: str, priority: PriorityName, field: str = "max_requests") -> str:
    """Envoy's own runtime key for a circuit-breaker threshold (priority segment lowercase)."""
    return f"circuit_breakers.{tier_cluster(upstream_cluster, priority)}.default.{field}"


def duration(seconds: float) -> str:
    return f"{seconds:.3f}s".replace(".000s", "s")


def _socket_address(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def http2_options(policy: MeshPolicy) -> dict[str, Any]:
    limits = policy.http2
    return {
        "initial_stream_window_size": limits.initial_stream_window_bytes,
        "initial_connection_window_size": limits.initial_connection_window_bytes,
        "max_concurrent_streams": limits.max_concurrent_streams,
    }


def _cluster(
    name: str,
    address: str,
    port: int,
    buffer_limit: int,
    http2: dict[str, Any],
    connect_timeout_s: float,
    http1: bool = False,
) -> dict[str, Any]:
    # vLLM's OpenAI server (uvicorn) speaks HTTP/1.1 only; its gRPC server and the processor HTTP/2.
    protocol = {"http_protocol_options": {}} if http1 else {"http2_protocol_options": http2}
    return {
        "name": name,
        "type": "STATIC" if _is_ip(address) else "STRICT_DNS",
        "connect_timeout": duration(connect_timeout_s),
        "lb_policy": "ROUND_ROBIN",
        "per_connection_buffer_limit_bytes": buffer_limit,
        "typed_extension_protocol_options": {
            HTTP_OPTIONS_KEY: {_TYPE: HTTP_OPTIONS_TYPE, "explicit_http_config": protocol}
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(address, port)}}]}],
        },
    }


def priority_cluster(policy: MeshPolicy, priority: PriorityName) -> dict[str, Any]:
    limits = policy.priorities.classes[priority]
    cluster = _cluster(
        policy.cluster_for(priority),
        policy.upstream.address,
        policy.upstream.port,
        policy.http2.per_connection_buffer_limit_bytes,
        http2_options(policy),
        policy.timeouts.connect_s,
        http1=policy.engine_api == "openai",
    )
    cluster["circuit_breakers"] = {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": limits.max_connections,
                "max_pending_requests": limits.max_pending_requests,
                "max_requests": limits.max_requests,
                "max_retries": limits.max_retries,
                "track_remaining": True,
            }
        ]
    }
    return cluster


def ext_proc_cluster(policy: MeshPolicy) -> dict[str, Any]:
    admission = policy.admission
    return _cluster(
        EXT_PROC_CLUSTER,
        admission.address,
        admission.port,
        policy.http2.per_connection_buffer_limit_bytes,
        {"max_concurrent_streams": policy.http2.max_concurrent_streams},
        min(policy.timeouts.connect_s, 0.25),
    )


def _priority_header(policy: MeshPolicy, priority: PriorityName) -> list[dict[str, Any]]:
    return [{"name": policy.priorities.header, "string_match": {"exact": priority, "ignore_case": True}}]


def _no_ext_proc() -> dict[str, Any]:
    return {EXT_PROC_FILTER: {_TYPE: _EXT_PROC_PER_ROUTE, "disabled": True}}


PRIORITY_METADATA = "x-sits-priority"


OPENAI_ENDPOINT_METADATA = "x-sits-openai-endpoint"


def _ext_proc_priority(priority: PriorityName, endpoint: str | None = None) -> dict[str, Any]:
    # Tells the processor the route's priority (and, on the HTTP path, which OpenAI endpoint) on the
    # ext_proc stream itself, so it needs no header round trip.
    metadata = [{"key": PRIORITY_METADATA, "value": priority}]
    if endpoint is not None:
        metadata.append({"key": OPENAI_ENDPOINT_METADATA, "value": endpoint})
    return {EXT_PROC_FILTER: {_TYPE: _EXT_PROC_PER_ROUTE, "overrides": {"grpc_initial_metadata": metadata}}}


def _runtime_percent(default: int, key: str) -> dict[str, Any]:
    return {"default_value": {"numerator": default, "denominator": "HUNDRED"}, "runtime_key": key}


def _forward(cluster: str) -> dict[str, Any]:
    # timeout 0s: a token stream may run for minutes; stream_idle_timeout bounds stalls.
    return {"cluster": cluster, "timeout": "0s"}


def _routed_tier(policy: MeshPolicy, priority: PriorityName) -> list[dict[str, Any]]:
    """The tier header, overwritten with the tier this route sends the request as.

    The engine (the SITS gRPC launcher) trusts this header for the request's priority: whatever a
    client wrote there or in its request id, it runs as the tier Envoy routed it by.
    """
    return [
        {
            "header": {"key": policy.priorities.header, "value": priority},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]


def routes(policy: MeshPolicy) -> list[dict[str, Any]]:
    """Shed routes first (runtime fraction, default 0%), then one pair per priority, then the default."""
    if policy.engine_api == "openai":
        return openai_routes(policy)
    generate = policy.admission.generate_path
    admission = policy.admission.enabled
    table: list[dict[str, Any]] = []
    for priority in reversed(SHEDDABLE):
        table.append(
            {
                "name": f"shed_{priority}",
                "match": {
                    "prefix": "/",
                    "headers": _priority_header(policy, priority),
                    "runtime_fraction": _runtime_percent(0, shed_key(priority)),
                },
                "direct_response": {
                    "status": 503,
                    "body": {"inline_string": f"shed by SITS: priority {priority} under GPU memory pressure"},
                },
                # A shed stream costs the processor nothing.
                **({"typed_per_filter_config": _no_ext_proc()} if policy.admission.enabled else {}),
            }
        )

    def pair(name: str, headers: list[dict[str, Any]], cluster: str, priority: PriorityName) -> list[dict[str, Any]]:
        generate_match: dict[str, Any] = {"path": generate}
        other_match: dict[str, Any] = {"prefix": "/"}
        if headers:
            generate_match["headers"] = headers
            other_match["headers"] = headers
        tier = _routed_tier(policy, priority)
        other: dict[str, Any] = {
            "name": f"{name}_other",
            "match": other_match,
            "route": _forward(cluster),
            "request_headers_to_add": tier,
        }
        if admission:
            other["typed_per_filter_config"] = _no_ext_proc()
        generate_route: dict[str, Any] = {
            "name": f"{name}_generate",
            "match": generate_match,
            "route": _forward(cluster),
            "request_headers_to_add": tier,
        }
        if not admission:
            return [generate_route, other]
        generate_route["typed_per_filter_config"] = _ext_proc_priority(priority)
        if not policy.admission.bypass_max_request_tokens:
            return [generate_route, other]
        bypass = {
            "name": f"{name}_generate_bypass",
            "match": {**generate_match, "runtime_fraction": _runtime_percent(0, ADMISSION_BYPASS_KEY)},
            "route": _forward(cluster),
            "request_headers_to_add": tier,
            "typed_per_filter_config": _no_ext_proc(),
        }
        return [bypass, generate_route, other]

    for priority in PRIORITY_NAMES:
        table += pair(priority, _priority_header(policy, priority), policy.cluster_for(priority), priority)
    default = policy.priorities.default
    table += pair("unlabelled", [], policy.cluster_for(default), default)
    return table


def tier_groups(policy: MeshPolicy) -> list[tuple[str, PriorityName, list[list[dict[str, Any]]]]]:
    """(name, tier, alternatives of header matchers) in match order; the default tier matches anything last.

    With tenants in the policy, the tier comes from the API key (or the tenant header a gateway sets):
    the client's own tier header matches nothing, so it cannot raise its tier.
    """
    http = policy.http
    groups: list[tuple[str, PriorityName, list[list[dict[str, Any]]]]] = []
    if http.tenants:
        for tenant in http.tenants:
            alternatives = [
                [{"name": "authorization", "string_match": {"exact": f"Bearer {key}"}}] for key in tenant.api_keys
            ]
            if http.tenant_header:
                alternatives.append([{"name": http.tenant_header, "string_match": {"exact": tenant.name}}])
            if alternatives:
                groups.append((f"tenant_{tenant.name}", tenant.tier, alternatives))
    else:
        groups += [(p, p, [_priority_header(policy, p)]) for p in PRIORITY_NAMES]
    groups.append(("unlabelled", policy.priorities.default, [[]]))
    return groups


OPENAI_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MODELS_PATH = "/v1/models"


def openai_routes(policy: MeshPolicy) -> list[dict[str, Any]]:
    """Per tier group: a runtime shed route, the two admitted endpoints, `/v1/models`; then 404 for the rest."""
    admission = policy.admission.enabled
    skip = {"typed_per_filter_config": _no_ext_proc()} if admission else {}
    table: list[dict[str, Any]] = []
    for name, tier, alternatives in tier_groups(policy):
        cluster = policy.cluster_for(tier)
        tier_header = _routed_tier(policy, tier)
        for index, headers in enumerate(alternatives):
            label = name if len(alternatives) == 1 else f"{name}_{index}"
            with_headers = {"headers": headers} if headers else {}
            if tier in SHEDDABLE:
                table.append(
                    {
                        "name": f"shed_{label}",
                        "match": {
                            "prefix": "/",
                            **with_headers,
                            "runtime_fraction": _runtime_percent(0, shed_key(tier)),
                        },
                        # 429 + Retry-After (local_reply_config): shed work may come back later.
                        "direct_response": {
                            "status": 429,
                            "body": {"inline_string": f"shed by SITS: priority {tier} under GPU memory pressure"},
                        },
                        **skip,
                    }
                )
            for endpoint, path in OPENAI_PATHS.items():
                route: dict[str, Any] = {
                    "name": f"{label}_{endpoint}",
                    "match": {"path": path, **with_headers},
                    "route": _forward(cluster),
                    "request_headers_to_add": tier_header,
                    # What Envoy holds of one body for the processor (BUFFERED); beyond it, 413.
                    "request_body_buffer_limit": policy.http.max_body_bytes,
                }
                if admission:
                    route["typed_per_filter_config"] = _ext_proc_priority(tier, endpoint)
                    if policy.admission.bypass_max_request_tokens:
                        table.append(_openai_bypass(policy, route))
                table.append(route)
            table.append(
                {
                    "name": f"{label}_models",
                    "match": {"prefix": MODELS_PATH, **with_headers},
                    "route": _forward(cluster),
                    "request_headers_to_add": tier_header,
                    **skip,
                }
            )
    table.append(
        {
            "name": "not_found",
            "match": {"prefix": "/"},
            "direct_response": {
                "status": 404,
                "body": {"inline_string": "the mesh serves /v1/completions, /v1/chat/completions and /v1/models"},
            },
            **skip,
        }
    )
    return table


def _openai_bypass(policy: MeshPolicy, inspected: dict[str, Any]) -> dict[str, Any]:
    """The twin of an inspected OpenAI route, taken while the bypass key is 100 (`sits_mesh/bypass.py`).

    It skips the processor, yet what the processor would refuse before the engine is still refused
    here, in Envoy: a body that is no JSON object (or not sent as JSON), a missing or unknown `model`.
    Envoy's JSON check (json_to_metadata) writes what it found; RBAC refuses on it (403, answered as
    400 by `local_reply_config`, the failed rule named in the error's code). Deeper mistakes (a
    missing prompt, a malformed message) reach vLLM, which answers them 400 itself.
    """
    model = [{"key": "model"}]
    present = {"metadata": {"filter": BODY_METADATA, "path": model, "value": {"present_match": True}}}
    is_invalid = {"string_match": {"exact": "invalid"}}
    invalid = {"metadata": {"filter": BODY_METADATA, "path": [{"key": "json"}], "value": is_invalid}}
    sent_as_json = {
        "or_rules": {
            "rules": [
                {"header": {"name": "content-type", "string_match": {"exact": kind}}} for kind in JSON_CONTENT_TYPES
            ]
        }
    }

    def all_of(*rules: dict[str, Any]) -> dict[str, Any]:
        return {"and_rules": {"rules": list(rules)}}

    # Exclusive, so that the rule the error names is the one that failed first.
    rules: dict[str, dict[str, Any]] = {
        "not_json_content_type": {"not_rule": sent_as_json},
        "invalid_json": all_of(sent_as_json, invalid),
        "missing_model": all_of(sent_as_json, {"not_rule": invalid}, {"not_rule": present}),
    }
    if policy.http.models:
        served = [
            {"metadata": {"filter": BODY_METADATA, "path": model, "value": {"string_match": {"exact": name}}}}
            for name in policy.http.models
        ]
        rules["unknown_model"] = all_of(present, {"not_rule": {"or_rules": {"rules": served}}})
    body_rules = {
        "action": "DENY",
        "policies": {name: {"permissions": [rule], "principals": [{"any": True}]} for name, rule in rules.items()},
    }
    return {
        **inspected,
        "name": f"{inspected['name']}_bypass",
        "match": {**inspected["match"], "runtime_fraction": _runtime_percent(0, ADMISSION_BYPASS_KEY)},
        "typed_per_filter_config": {
            **_no_ext_proc(),
            **({HOLD_FILTER: {_TYPE: _BUFFER_PER_ROUTE, "disabled": True}} if _holds_until_admitted(policy) else {}),
            BODY_RULES_FILTER: {
                _TYPE: _FILTER_CONFIG,
                "disabled": False,
                "config": {_TYPE: _RBAC_PER_ROUTE, "rbac": {"rules": body_rules}},
            },
        },
    }


def _json_check_filters(policy: MeshPolicy) -> list[dict[str, Any]]:
    """Envoy's own check of an OpenAI body: its JSON read on every request (a C++ parse of the body),
    its rules off by default and turned on by the bypass routes. json_to_metadata takes no per-route
    config, so it cannot be turned on per route as RBAC is."""
    model = {"metadata_namespace": BODY_METADATA, "key": "model"}
    return [
        {
            "name": JSON_CHECK_FILTER,
            "typed_config": {
                _TYPE: _JSON_TO_METADATA,
                "request_rules": {
                    "rules": [
                        {
                            "selectors": [{"key": "model"}],
                            "on_present": {**model, "type": "STRING"},
                            "on_error": {
                                "metadata_namespace": BODY_METADATA,
                                "key": "json",
                                "value": "invalid",
                            },
                        }
                    ],
                    "allow_content_types": list(JSON_CONTENT_TYPES),
                },
                # The body it reads is bounded by the route's request_body_buffer_limit (413 beyond).
            },
        },
        # Per route (the bypass routes name their rules); no rules here: off, and allow-all if ever on.
        {"name": BODY_RULES_FILTER, "disabled": True, "typed_config": {_TYPE: _RBAC}},
    ]


def _openai_error(error_type: str) -> dict[str, Any]:
    # The reason travels as the local reply's body; the code is Envoy's (or the processor's) response detail.
    return {
        "json_format": {
            "error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type, "code": "%RESPONSE_CODE_DETAILS%"}
        }
    }


def _status_is(code: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"sits.local_reply.{code}"}}
        }
    }


def local_reply_config(policy: MeshPolicy) -> dict[str, Any]:
    """Every reply Envoy or the processor makes on the HTTP path, in OpenAI's error format.

    Shedding (runtime shed routes, the processor under pressure, a tier's breaker overflowing: the
    controller's budget) and rate limits are 429 with Retry-After; overload is 503 with Retry-After.
    """
    retry_after = [
        {
            "header": {"key": "retry-after", "value": str(policy.http.retry_after_s)},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    return {
        "mappers": [
            {
                "filter": {"response_flag_filter": {"flags": ["UO"]}},
                "status_code": 429,
                "headers_to_add": retry_after,
                "body_format_override": _openai_error("rate_limit_error"),
            },
            {
                "filter": _status_is(429),
                "headers_to_add": retry_after,
                "body_format_override": _openai_error("rate_limit_error"),
            },
            {
                "filter": _status_is(503),
                "headers_to_add": retry_after,
                "body_format_override": _openai_error("overloaded_error"),
            },
            *(
                {"filter": _status_is(code), "body_format_override": _openai_error("invalid_request_error")}
                for code in (400, 404, 413)
            ),
            {
                # Only the bypass routes' body rules answer 403 here: a bad request, named in the code.
                "filter": _status_is(403),
                "status_code": 400,
                "body": {
                    "inline_string": "SITS refused the request at the mesh: it needs a JSON object body "
                    "(content-type application/json) naming a served 'model'"
                },
                "body_format_override": _openai_error("invalid_request_error"),
            },
        ],
        "body_format": _openai_error("server_error"),
    }


def http_filters(policy: MeshPolicy) -> list[dict[str, Any]]:
    rate = policy.rate_limit
    filters: list[dict[str, Any]] = [
        {
            "name": LOCAL_RATELIMIT_FILTER,
            "typed_config": {
                _TYPE: _LOCAL_RATELIMIT,
                "stat_prefix": RATELIMIT_STAT_PREFIX,
                "token_bucket": {
                    "max_tokens": rate.max_tokens,
                    "tokens_per_fill": rate.tokens_per_fill,
                    "fill_interval": duration(rate.fill_interval_s),
                },
                "filter_enabled": _runtime_percent(rate.enabled_percent, RATELIMIT_ENABLED_KEY),
                "filter_enforced": _runtime_percent(rate.enforced_percent, RATELIMIT_ENFORCED_KEY),
                "rate_limited_as_resource_exhausted": True,
            },
        }
    ]
    if policy.admission.enabled:
        if policy.engine_api == "openai" and policy.admission.bypass_max_request_tokens:
            filters += _json_check_filters(policy)
        filters.append({"name": EXT_PROC_FILTER, "typed_config": ext_proc_filter(policy)})
        if _holds_until_admitted(policy):
            filters.append(_hold_until_admitted(policy))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {_TYPE: _ROUTER}})
    return filters


def _holds_until_admitted(policy: MeshPolicy) -> bool:
    return policy.admission.enabled and policy.engine_api == "openai" and not policy.admission.send_headers


def _hold_until_admitted(policy: MeshPolicy) -> dict[str, Any]:
    """Holds the request's headers from the router until its whole body has passed the processor.

    Without a header phase (ext_proc skips the headers), the router would open the upstream request
    on the headers, before admission answers: a refused request would reach the engine as headers
    and a reset. The processor learns the tier and endpoint from the route (`_ext_proc_priority`),
    so the one body message is all it needs: a round trip to the processor less per request, about
    0.5 ms at p50 (docs/http.md). The bypass routes, which skip the processor, skip this too.
    """
    return {"name": HOLD_FILTER, "typed_config": {_TYPE: _BUFFER, "max_request_bytes": policy.http.max_body_bytes}}


def ext_proc_filter(policy: MeshPolicy) -> dict[str, Any]:
    admission = policy.admission
    return {
        _TYPE: _EXT_PROC,
        "grpc_service": {
            "envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER},
            "timeout": duration(admission.message_timeout_s),
        },
        # Fail open: a processor that is down must not stop inference; Envoy
        # counts each such request in http.<prefix>.ext_proc.failure_mode_allowed.
        "failure_mode_allow": True,
        "message_timeout": duration(admission.message_timeout_s),
        "stat_prefix": ADMISSION_STAT_PREFIX,
        # STREAMED: the processor sees the prompt chunk by chunk, so a huge
        # prompt is judged without Envoy buffering it whole.
        "processing_mode": {
            # The route names the tier (and on the HTTP path the endpoint) in the stream's metadata, so
            # the headers go only where no SITS route does (an Istio sidecar sets send_headers).
            "request_header_mode": "SEND" if admission.send_headers else "SKIP",
            "response_header_mode": "SKIP",
            # A JSON body is judged whole: Envoy buffers it (up to http.max_body_bytes, else 413).
            "request_body_mode": "BUFFERED" if policy.engine_api == "openai" else admission.body_mode,
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }


ACCESS_LOG_FORMAT = (
    "[%START_TIME%] %REQ(:PATH)% http=%RESPONSE_CODE% grpc=%GRPC_STATUS_NUMBER% "
    "priority=%REQ(X-SITS-PRIORITY)% cluster=%UPSTREAM_CLUSTER% traceparent=%REQ(TRACEPARENT)% "
    "flags=%RESPONSE_FLAGS% duration_ms=%DURATION%\n"
)
_FILE_ACCESS_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def connection_manager(policy: MeshPolicy) -> dict[str, Any]:
    manager = _connection_manager(policy)
    if policy.access_log_path:
        manager["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    _TYPE: _FILE_ACCESS_LOG,
                    "path": policy.access_log_path,
                    "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
                },
            }
        ]
    return manager


def _connection_manager(policy: MeshPolicy) -> dict[str, Any]:
    manager: dict[str, Any] = {
        _TYPE: _HCM,
        "stat_prefix": INGRESS_STAT_PREFIX,
        # gRPC clients speak HTTP/2; OpenAI clients HTTP/1.1 or HTTP/2 (prior knowledge or upgrade-free h2c).
        "codec_type": "AUTO" if policy.engine_api == "openai" else "HTTP2",
        "http2_protocol_options": http2_options(policy),
        # Bounds an SSE stream that stopped moving (either way); token streams have no route timeout.
        "stream_idle_timeout": duration(policy.timeouts.stream_idle_s),
        "request_timeout": "0s",
        "route_config": {
            "name": "sits_routes",
            "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": routes(policy)}],
        },
        "http_filters": http_filters(policy),
    }
    if policy.engine_api == "openai":
        manager["local_reply_config"] = local_reply_config(policy)
    return manager


def overload_manager(policy: MeshPolicy) -> dict[str, Any]:
    overload = policy.overload
    return {
        "refresh_interval": duration(overload.refresh_interval_s),
        "resource_monitors": [
            {"name": INJECTED_RESOURCE, "typed_config": {_TYPE: _INJECTED, "filename": overload.pressure_file}}
        ],
        "actions": [
            {
                "name": STOP_ACCEPTING_ACTION,
                "triggers": [{"name": INJECTED_RESOURCE, "threshold": {"value": overload.stop_accepting_at}}],
            }
        ],
        "loadshed_points": [
            {
                "name": DECODE_HEADERS_SHED_POINT,
                "triggers": [{"name": INJECTED_RESOURCE, "threshold": {"value": overload.shed_at}}],
            }
        ],
    }


def runtime_defaults(policy: MeshPolicy) -> dict[str, Any]:
    """The static layer: every SITS runtime key with its default, so /runtime shows them all."""
    defaults: dict[str, Any] = {shed_key(p): 0 for p in SHEDDABLE}
    defaults[RATELIMIT_ENABLED_KEY] = policy.rate_limit.enabled_percent
    defaults[RATELIMIT_ENFORCED_KEY] = policy.rate_limit.enforced_percent
    if policy.admission.enabled and policy.admission.bypass_max_request_tokens:
        defaults[ADMISSION_BYPASS_KEY] = 0
    for priority in PRIORITY_NAMES:
        limits = policy.priorities.classes[priority]
        defaults[breaker_key(policy.upstream_cluster, priority, "max_requests")] = limits.max_requests
        defaults[breaker_key(policy.upstream_cluster, priority, "max_pending_requests")] = limits.max_pending_requests
        defaults[breaker_key(policy.upstream_cluster, priority, "max_connections")] = limits.max_connections
    return defaults


def render_bootstrap(policy: MeshPolicy) -> dict[str, Any]:
    clusters = [priority_cluster(policy, p) for p in PRIORITY_NAMES]
    if policy.admission.enabled:
        clusters.append(ext_proc_cluster(policy))
    return {
        "node": {"id": f"{policy.name}-mesh", "cluster": policy.name},
        "admin": {"address": _socket_address(policy.admin.address, policy.admin.port)},
        "layered_runtime": {
            "layers": [
                {"name": "static", "static_layer": runtime_defaults(policy)},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "overload_manager": overload_manager(policy),
        "static_resources": {
            "listeners": [
                {
                    "name": "sits_ingress",
                    "address": _socket_address(policy.listener.address, policy.listener.port),
                    "per_connection_buffer_limit_bytes": policy.http2.per_connection_buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": connection_manager(policy),
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": clusters,
        },
    }


def to_yaml(document: dict[str, Any]) -> str:
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def render_bootstrap_yaml(policy: MeshPolicy) -> str:
    return to_yaml(render_bootstrap(policy))
