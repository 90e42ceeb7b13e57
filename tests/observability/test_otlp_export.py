"""Spans leave a real process over OTLP/gRPC with its service.name and the right parents."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.fixtures.otlp import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]

# Two processes, as two services would be: the first starts a trace and hands
# its context on in Kafka-style headers (printed), the second continues it.
PRODUCER = """
import sys
from opentelemetry import trace
from sits.runtime.tracing import inject_headers, setup_tracing
provider = setup_tracing("sits-probe-producer", sys.argv[1])
tracer = trace.get_tracer("probe")
with tracer.start_as_current_span("capture sample"):
    with tracer.start_as_current_span("publish") as span:
        headers = []
        inject_headers(headers)
provider.shutdown()
print(dict(headers)["traceparent"].decode())
"""

CONSUMER = """
import sys
from opentelemetry import context, trace
from sits.runtime.tracing import extract_headers, setup_tracing
provider = setup_tracing("sits-probe-consumer", sys.argv[1])
token = context.attach(extract_headers([("traceparent", sys.argv[2].encode())]))
with trace.get_tracer("probe").start_as_current_span("decide"):
    pass
context.detach(token)
provider.shutdown()
"""


async def run_python(code: str, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


async def test_spans_arrive_with_service_name_and_parents(otlp_receiver: OtlpReceiver) -> None:
    traceparent = await run_python(PRODUCER, otlp_receiver.endpoint)
    await run_python(CONSUMER, otlp_receiver.endpoint, traceparent)

    spans = await otlp_receiver.wait_for(lambda s: len(s) >= 3)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"capture sample", "publish", "decide"}
    root, publish, decide = by_name["capture sample"], by_name["publish"], by_name["decide"]
    assert root.service_name == publish.service_name == "sits-probe-producer"
    assert decide.service_name == "sits-probe-consumer"
    assert root.parent_span_id == ""
    assert publish.parent_span_id == root.span_id
    assert decide.parent_span_id == publish.span_id  # across the process boundary
    assert len({s.trace_id for s in spans}) == 1
    assert traceparent.split("-")[1] == root.trace_id
