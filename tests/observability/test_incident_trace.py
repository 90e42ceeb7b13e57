"""One trace follows an OOM from capture's ReportOom through the decision, the action
and the verdict: four services, exported over OTLP/gRPC to a real receiver, each hop
a span whose parent is the hop before it (across gRPC and Kafka).

Needs the whole embedded stack and the shared vLLM engine (the executor acts on it).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import grpc
import pytest

from sits.runtime.events import Topics
from sits.runtime.grpcserver import bearer_metadata
from sits.v1 import capture_pb2_grpc, common_pb2, events_pb2, validator_pb2, validator_pb2_grpc
from sits_app.stack.embedded import EmbeddedStack, StackConfig
from sits_app.stack.vllm_engine import VllmServer
from tests.fixtures.otlp import OtlpReceiver, ReceivedSpan

SERVICE_NAMES = {"sits-capture", "sits-decision", "sits-executor", "sits-validator"}
ENGINE = "vllm-0"
SETTLE_S = 1.0
GIB = 1 << 30


def oom_event(host: str) -> events_pb2.OomEvent:
    event = events_pb2.OomEvent(
        requested_bytes=2 * GIB,
        device_free_bytes=GIB // 4,
        device_total_bytes=80 * GIB,
        device_index=0,
        pid=4242,
        message="CUDA out of memory. Tried to allocate 2.00 GiB",
    )
    event.meta.source = "test/oom-hook"
    event.meta.target.CopyFrom(common_pb2.Target(host=host, gpu_uuid="GPU-test-0", engine=ENGINE))
    return event


def one_span(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service_name == service and s.name == name]
    assert len(found) == 1, (
        f"expected one {service}:{name}, got {len(found)} of {[(s.service_name, s.name) for s in spans]}"
    )
    return found[0]


@pytest.mark.vllm
async def test_one_trace_from_oom_report_to_verdict(
    otlp_receiver: OtlpReceiver, vllm_engine: VllmServer, redis_url: str, topic_prefix: str, tmp_path: Path
) -> None:
    assert vllm_engine.control_address is not None
    targets = {ENGINE: {"engine_addr": vllm_engine.address, "control_addr": vllm_engine.control_address}}
    config = StackConfig(
        run_dir=tmp_path,
        redis_url=redis_url,
        topic_prefix=topic_prefix,
        extra_env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
            "SITS_EXECUTOR_TARGETS": json.dumps(targets),
            "SITS_VALIDATOR_SETTLE_S": json.dumps(
                dict.fromkeys(
                    (
                        "SET_ENGINE_LIMITS",
                        "SHED_PRIORITY",
                        "SET_PRESSURE",
                        "FLUSH_CACHE",
                        "ABORT_LOW_PRIORITY",
                        "PAUSE_ADMISSION",
                        "RESUME_ADMISSION",
                    ),
                    SETTLE_S,
                )
            ),
        },
    )
    topics = Topics(topic_prefix)
    # The OOM hook starts the trace and sends it as W3C traceparent in the call metadata.
    trace_id, hook_span_id = secrets.token_hex(16), secrets.token_hex(8)
    async with EmbeddedStack(config) as stack:
        token = stack.token_file.read_text().strip()
        async with (
            grpc.aio.insecure_channel(stack.address_of("validator")) as validator_channel,
            grpc.aio.insecure_channel(stack.address_of("capture")) as capture_channel,
        ):
            validator = validator_pb2_grpc.ValidatorStub(validator_channel)  # type: ignore[no-untyped-call]
            capture = capture_pb2_grpc.CaptureStub(capture_channel)  # type: ignore[no-untyped-call]
            verdicts = validator.StreamVerdicts(validator_pb2.StreamVerdictsRequest(), timeout=60)
            await asyncio.sleep(0.2)  # the stream is registered before the incident starts
            reply = await capture.ReportOom(
                oom_event(stack.settings.host_name),
                metadata=(*bearer_metadata(token), ("traceparent", f"00-{trace_id}-{hook_span_id}-01")),
                timeout=5,
            )
            assert reply.event_id
            verdict = await asyncio.wait_for(verdicts.read(), timeout=45)
            verdicts.cancel()
    assert isinstance(verdict, events_pb2.ValidationVerdict)
    assert verdict.trace_id == trace_id

    # The services flushed their span batches when they stopped.
    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {s.service_name for s in spans if s.trace_id == trace_id}
        return names >= SERVICE_NAMES and any(s.name == "validate action" for s in spans)

    spans = [s for s in await otlp_receiver.wait_for(complete, timeout_s=20) if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in spans}

    # Every span's parent arrived too, except the first, whose parent is the hook's span.
    roots = [s for s in spans if s.parent_span_id not in by_id]
    assert [(r.service_name, r.parent_span_id) for r in roots] == [("sits-capture", hook_span_id)]

    # Hop by hop: Kafka producer -> consumer in the next service.
    capture_oom = one_span(spans, "sits-capture", f"{topics.oom} publish")
    decision_in = one_span(spans, "sits-decision", f"{topics.oom} process")
    assert decision_in.parent_span_id == capture_oom.span_id
    decision_out = [s for s in spans if s.service_name == "sits-decision" and s.name == f"{topics.commands} publish"]
    assert decision_out, "the decision published no command in this trace"
    executor_in = [s for s in spans if s.service_name == "sits-executor" and s.name == f"{topics.commands} process"]
    assert executor_in and executor_in[0].parent_span_id in {s.span_id for s in decision_out}
    executor_out = [s for s in spans if s.service_name == "sits-executor" and s.name == f"{topics.results} publish"]
    assert executor_out
    validator_in = [s for s in spans if s.service_name == "sits-validator" and s.name == f"{topics.results} process"]
    assert validator_in and validator_in[0].parent_span_id in {s.span_id for s in executor_out}
    validate = one_span(spans, "sits-validator", "validate action")
    assert validate.parent_span_id in {s.span_id for s in executor_out}
    verdict_out = one_span(spans, "sits-validator", f"{topics.validation} publish")
    assert by_id[verdict_out.parent_span_id].name == "validate action"
