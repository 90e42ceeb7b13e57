"""Bad input: property-based fuzzing of every decoder and of the services' gRPC request validation.

Decoders never crash: they return a value or raise their own error with a reason. Undecodable Kafka
records land in the dead-letter topic with the reason and the consumer goes on. Every gRPC method
answers bad requests with a status and a reason (INVALID_ARGUMENT for bad values), never
UNKNOWN/INTERNAL, and stays SERVING; messages over the configured size are refused.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bench import reliability_harness as h
from services.capture.spool import RecordKind, Spool, SpoolRecord
from services.decision.domain.policy import PolicyError, parse_policy
from sits.runtime.bus import EventConsumer, EventProducer, ReceivedEvent, ensure_topics
from sits.runtime.events import DLQ_REASON_HEADER, EVENT_TYPES, EnvelopeError, Topics, decode_event
from sits.runtime.settings import Settings
from sits.runtime.traces import TraceFormatError, read_trace
from sits.v1 import (
    capture_pb2,
    common_pb2,
    decision_pb2,
    events_pb2,
    executor_pb2,
    validator_pb2,
)
from tests.reliability.conftest import MAX_MESSAGE_BYTES
from tests.reliability.protofuzz import messages
from tests.reliability.service_stubs import service_stubs
from tests.waiting import eventually

TYPE_NAMES = sorted(EVENT_TYPES)
header_names = st.sampled_from(["ce_specversion", "ce_type", "content-type", "ce_id", "traceparent", "x"])
header_values = st.one_of(
    st.sampled_from([b"1.0", b"application/protobuf", *(t.encode() for t in TYPE_NAMES), b"00-zz"]),
    st.binary(max_size=30),
)
headers_strategy = st.lists(st.tuples(header_names, header_values), max_size=8)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- pure decoders


@FUZZ
@given(headers=headers_strategy, value=st.one_of(st.none(), st.binary(max_size=200)))
def test_event_decoder_returns_an_event_or_an_envelope_error(
    headers: list[tuple[str, bytes]], value: bytes | None
) -> None:
    try:
        message = decode_event(headers, value)
    except EnvelopeError as err:
        assert str(err) and err.category in {"malformed_header", "unknown_type", "undecodable"}
    else:
        assert message.DESCRIPTOR.full_name in EVENT_TYPES


@FUZZ
@given(kind=st.sampled_from(TYPE_NAMES), value=st.binary(max_size=200))
def test_event_decoder_on_well_labelled_garbage(kind: str, value: bytes) -> None:
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_type", kind.encode()),
        ("content-type", b"application/protobuf"),
        ("ce_id", b"id-1"),
    ]
    try:
        decode_event(headers, value)
    except EnvelopeError as err:
        assert err.category == "undecodable" and str(err)


@FUZZ
@given(
    lines=st.lists(
        st.one_of(
            st.text(max_size=80),
            st.sampled_from(
                [
                    '{"format": "sits-trace", "version": 1, "name": "x"}',
                    '{"t": 1, "kind": "sample"}',
                    '{"t": -1}',
                    "[]",
                    "null",
                    '{"t": 0.5, "kind": "oom", "requested_bytes": "x"}',
                    '{"t": "nan", "kind": "sample", "gpu": 3}',
                ]
            ),
        ),
        max_size=6,
    ),
    gz=st.booleans(),
)
def test_trace_reader_refuses_bad_files_with_a_reason(lines: list[str], gz: bool, tmp_path_factory: Any) -> None:
    # A JSON line that is not an object crashes the reader (the known bug below); everything else is fuzzed.
    assume(not any(_json_but_not_object(line) for line in lines))
    path = Path(tmp_path_factory.mktemp("trace")) / ("t.jsonl.gz" if gz else "t.jsonl")
    data = "\n".join(lines).encode("utf-8", errors="surrogatepass") if lines else b""
    path.write_bytes(gzip.compress(data) if gz else data)
    try:
        read_trace(path)
    except (TraceFormatError, UnicodeDecodeError) as err:
        assert str(err)


def _json_but_not_object(line: str) -> bool:
    try:
        return not isinstance(json.loads(line), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("line", ["[]", "3", "null", '"text"'])
def test_trace_reader_refuses_a_line_that_is_json_but_not_an_object(line: str, tmp_path: Path) -> None:
    """Found by the fuzzing above: `[]` as the header (or as a record) is a format error, like any other."""
    for lines in ([line], ['{"format": "sits-trace", "version": 1, "name": "x"}', line]):
        path = tmp_path / "t.jsonl"
        path.write_text("\n".join(lines))
        with pytest.raises(TraceFormatError):
            read_trace(path)


@FUZZ
@given(
    text=st.one_of(st.text(max_size=300), st.sampled_from([h.POLICY_YAML, "rules: 3", "{", "rules: [{name: x}]"])),
    cut=st.integers(0, 400),
)
def test_policy_parser_refuses_bad_policies_with_a_reason(text: str, cut: int) -> None:
    for candidate in (text, h.POLICY_YAML[:cut]):
        try:
            parse_policy(candidate)
        except PolicyError as err:
            assert err.problems and str(err)


@FUZZ
@given(tail=st.binary(min_size=1, max_size=300))
def test_capture_spool_reopens_after_garbage_is_appended_to_a_segment(tail: bytes, tmp_path_factory: Any) -> None:
    """A crash mid-write leaves a torn tail: the spool reopens, keeps every whole record and goes on."""
    folder = Path(tmp_path_factory.mktemp("spool"))
    spool = Spool(folder, max_bytes=1 << 20)
    for i in range(3):
        spool.append(SpoolRecord(RecordKind.METRIC, "t", f"record-{i}".encode()))
    spool.close()
    segments = sorted(p for p in folder.iterdir() if p.is_file() and "cursor" not in p.name)
    with segments[-1].open("ab") as stream:
        stream.write(tail)
    reopened = Spool(folder, max_bytes=1 << 20)
    payloads = [r.payload for r in reopened.peek(10)]
    reopened.append(SpoolRecord(RecordKind.METRIC, "t", b"after"))
    assert payloads[:3] == [b"record-0", b"record-1", b"record-2"]
    reopened.close()


# ---------------------------------------------------------------------------- the consumer: dead letters


def _fuzzed_records() -> list[tuple[list[tuple[str, bytes]], bytes | None]]:
    collected: list[tuple[list[tuple[str, bytes]], bytes | None]] = []

    @settings(max_examples=120, deadline=None, database=None)
    @given(headers=headers_strategy, value=st.one_of(st.none(), st.binary(max_size=120)))
    def collect(headers: list[tuple[str, bytes]], value: bytes | None) -> None:
        collected.append((headers, value))

    collect()
    return collected


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_consumer_dead_letters_every_undecodable_record_with_its_reason_and_goes_on(settings: Settings) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings)
    fuzzed = _fuzzed_records()
    valid = h.oom_event(common_pb2.Target(host="h", engine="e"), time.time())
    handled: list[str] = []

    async def handler(event: ReceivedEvent) -> None:
        handled.append(event.message.meta.event_id)  # type: ignore[attr-defined]

    expected_dead: dict[int, str] = {}
    async with EventProducer(settings) as producer:
        for index, (headers, value) in enumerate(fuzzed):
            try:
                decode_event(headers, value)
            except EnvelopeError as err:
                expected_dead[index] = str(err)
            await producer.forward_raw(topics.oom, str(index).encode(), value, headers)
        await producer.publish(topics.oom, valid)
        stop = asyncio.Event()
        consumer = EventConsumer(
            settings,
            group_id=f"{settings.topic_prefix}fuzz",
            topics=[topics.oom],
            handler=handler,
            dead_letters=producer,
            coalesce=False,
        )
        async with consumer:
            run = asyncio.create_task(consumer.run(stop))
            assert await eventually(lambda: valid.meta.event_id in handled, timeout_s=60)
            assert await eventually(lambda: consumer.stats.dead_lettered >= len(expected_dead), timeout_s=30)
            stop.set()
            await run
    dead = (await h.read_topics(settings.kafka_bootstrap, [topics.deadletter]))[topics.deadletter]
    reasons = {int(r.header("sits_dlq_offset") or "-1"): r.header(DLQ_REASON_HEADER) for r in dead}
    assert len(dead) == len(expected_dead) > 0
    assert all(reasons.values()), "every dead letter carries its reason"
    assert consumer.stats.handled == len(fuzzed) - len(expected_dead) + 1


# ---------------------------------------------------------------------------- gRPC request validation

# FAILED_PRECONDITION: PutPolicy's optimistic concurrency (expected_version not current).
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}
# Bugs this fuzzing found and that are not fixed yet; each is counted and must stay the only exception.
KNOWN_BUGS: set[tuple[str, str]] = set()
# Engine actions and GetLimits reach the (absent) engine: UNAVAILABLE naming it is the right answer there.
ENGINE_BOUND = {"Executor/Apply", "Executor/GetLimits"}


def _requests(cls: type[Message], names: list[str], count: int) -> list[Message]:
    collected: list[Message] = []

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message=messages(cls, names))
    def collect(message: Message) -> None:
        collected.append(message)

    collect()
    return collected


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_every_grpc_method_answers_fuzzed_requests_with_a_status_and_a_reason(
    api_stack: h.ReliabilityStack,
) -> None:
    rs = api_stack
    names = [*rs.engines, rs.host, "GPU-rel-0", "vllm-0"]
    auth = (("authorization", f"Bearer {rs.token}"),)
    async with service_stubs(rs.stack) as stubs:
        capture, decision, executor, validator = stubs.capture, stubs.decision, stubs.executor, stubs.validator
        methods: dict[str, tuple[Any, type[Message]]] = {
            "Capture/ReportOom": (capture.ReportOom, events_pb2.OomEvent),
            "Capture/GetSnapshot": (capture.GetSnapshot, capture_pb2.GetSnapshotRequest),
            "Decision/Admit": (decision.Admit, decision_pb2.AdmitRequest),
            "Decision/Evaluate": (decision.Evaluate, decision_pb2.EvaluateRequest),
            "Decision/Explain": (decision.Explain, decision_pb2.ExplainRequest),
            "Decision/PutPolicy": (decision.PutPolicy, decision_pb2.PutPolicyRequest),
            "Executor/Apply": (executor.Apply, events_pb2.HealingCommand),
            "Executor/Rollback": (executor.Rollback, executor_pb2.RollbackRequest),
            "Executor/ListActions": (executor.ListActions, executor_pb2.ListActionsRequest),
            "Executor/GetLimits": (executor.GetLimits, executor_pb2.GetLimitsRequest),
            "Validator/GetVerdict": (validator.GetVerdict, validator_pb2.GetVerdictRequest),
            "Validator/ListVerdicts": (validator.ListVerdicts, validator_pb2.ListVerdictsRequest),
        }
        outcomes: dict[str, dict[str, int]] = {}
        known_bugs = 0
        for method, (call, cls) in methods.items():
            for request in _requests(cls, names, 40):
                try:
                    await call(request, metadata=auth, timeout=15)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.aio.AioRpcError as err:
                    code, details = err.code(), err.details() or ""
                    assert details, (method, code, request)
                if code == grpc.StatusCode.UNKNOWN and any(m == method and t in details for m, t in KNOWN_BUGS):
                    known_bugs += 1
                    continue
                allowed = ALLOWED | ({grpc.StatusCode.UNAVAILABLE} if method in ENGINE_BOUND else set())
                assert code in allowed, (method, code, details, request)
                outcomes.setdefault(method, {})[code.name] = outcomes.setdefault(method, {}).get(code.name, 0) + 1
        # Range checks really ran: every mutating or checking method refused something.
        for method in ("Capture/ReportOom", "Decision/Admit", "Executor/Apply", "Validator/ListVerdicts"):
            assert outcomes[method].get("INVALID_ARGUMENT", 0) > 0, outcomes
        for service in ("Capture", "Decision", "Executor", "Validator"):
            health = health_pb2_grpc.HealthStub(stubs.channels[service.lower()])
            reply = await health.Check(health_pb2.HealthCheckRequest(service=f"sits.v1.{service}"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
async def test_oversized_messages_are_refused(api_stack: h.ReliabilityStack) -> None:
    rs = api_stack
    auth = (("authorization", f"Bearer {rs.token}"),)
    big = "x" * (MAX_MESSAGE_BYTES + 1)
    async with service_stubs(rs.stack) as stubs:
        oom = h.oom_event(rs.target(0), time.time())
        oom.message = big
        command = h.pressure_command(rs.target(0), 0.5, 60)
        command.reason = big
        calls = [
            stubs.capture.ReportOom(oom, metadata=auth, timeout=5),
            stubs.executor.Apply(command, metadata=auth, timeout=5),
            stubs.decision.PutPolicy(decision_pb2.PutPolicyRequest(yaml=big), metadata=auth, timeout=5),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cast(Awaitable[Any], call)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    records = await h.read_topics(rs.settings.kafka_bootstrap, [rs.topics.oom, rs.topics.results])
    assert not any(
        r.message() is not None and getattr(r.message(), "command_id", "") == command.command_id
        for r in records[rs.topics.results]
    )
