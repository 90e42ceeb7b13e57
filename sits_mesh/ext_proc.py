"""The admission external processor: Envoy `ext_proc` served by SITS over grpc.aio.

Envoy streams each Generate's headers and body chunks here (STREAMED mode).
Earlier chunks pass at once; the chunk that completes the gRPC message is held
until the `Admitter` (the decision service's Admit) answers, so the engine never
receives a whole request that was refused. Refusals are local gRPC replies:
RESOURCE_EXHAUSTED with a reason a person can read; priority shedding under
pressure answers UNAVAILABLE. Anything that goes wrong here fails open: Envoy is
configured with `failure_mode_allow`, and an admitter that cannot answer admits
(counted in `ProcessorCounters.fail_open`).

Responses are `envoy-data-plane` (betterproto2) messages, the common ones
serialized once; requests are read by `ext_proc_wire`, which decodes only the
fields used here. The server is grpc.aio with a generic handler, like every
other SITS server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import grpc
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyResponse,
    CommonResponse,
    GrpcStatus,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from prometheus_client import Counter, Gauge

from sits.runtime.clock import Clock, SystemClock
from sits.runtime.contract import Tier
from sits.v1 import common_pb2, decision_pb2, decision_pb2_grpc
from sits_mesh.admission import (
    MAX_BODY_BYTES,
    AdmissionQuery,
    Admitter,
    AdmitterUnavailable,
    GenerateShape,
    NotAGenerateRequest,
    RecentFreeKv,
    Verdict,
    fallback_verdict,
    frame_complete,
    parse_generate,
    priority_of,
    refusal_message,
    shed_reason,
)
from sits_mesh.bypass import BypassGate, Probe
from sits_mesh.envoy_config import ADMISSION_BYPASS_KEY, OPENAI_ENDPOINT_METADATA, OPENAI_PATHS, PRIORITY_METADATA
from sits_mesh.envoy_process import EnvoyError
from sits_mesh.ext_proc_wire import ExtProcRequest, Phase, decode_processing_request
from sits_mesh.openai_admission import (
    Endpoint,
    OpenAIRequestError,
    OpenAIShape,
    TokenCounter,
    byte_count,
    parse_openai,
    tokenizer_counter,
)
from sits_mesh.policy import MeshPolicy, PriorityName
from sits_mesh.pressure import read_pressure

log = logging.getLogger(__name__)

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_UNAVAILABLE = 14


class PressureSource(Protocol):
    def current(self) -> float | None: ...


class FilePressure:
    """The pressure file Envoy's overload manager reads, re-read at most every `max_age_s`."""

    def __init__(self, path: Path, clock: Clock | None = None, max_age_s: float = 0.05) -> None:
        self.path = path
        self._clock = clock or SystemClock()
        self._max_age_s = max_age_s
        self._value: float | None = None
        self._read_at = float("-inf")

    def current(self) -> float | None:
        now = self._clock.monotonic()
        if now - self._read_at >= self._max_age_s:
            self._value = read_pressure(self.path)
            self._read_at = now
        return self._value


class NoPressure:
    def current(self) -> float | None:
        return None


class DecisionAdmitter:
    """Asks the decision service's `Admit` over gRPC; raises AdmitterUnavailable when it cannot.

    `credentials`: TLS (and a client certificate) for a decision service that serves TLS
    (`sits.runtime.grpc_tls.channel_credentials(settings)`); None: plaintext, as under Istio.
    """

    def __init__(
        self,
        address: str,
        target: common_pb2.Target,
        timeout_s: float = 0.2,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._channel = (
            grpc.aio.insecure_channel(address) if credentials is None else grpc.aio.secure_channel(address, credentials)
        )
        self._stub = decision_pb2_grpc.DecisionStub(self._channel)
        self._target = target
        self._timeout_s = timeout_s

    async def admit(self, query: AdmissionQuery) -> Verdict:
        request = decision_pb2.AdmitRequest(
            target=self._target,
            prompt_tokens=query.prompt_tokens,
            max_tokens=query.max_tokens,
            priority=common_pb2.Priority.ValueType(Tier.parse(query.priority).to_proto()),
            prompt_logprobs=query.prompt_logprobs,
        )
        try:
            reply = await self._stub.Admit(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            raise AdmitterUnavailable(f"{err.code().name}: {err.details()}") from None
        return Verdict(
            admitted=reply.admitted,
            reason=reply.reason,
            kv_bytes_needed=reply.kv_bytes_needed,
            kv_bytes_free=reply.kv_bytes_free,
        )

    async def close(self) -> None:
        await self._channel.close(None)


# Names are the contract in deploy/METRICS.md (the alert rules and dashboard read them).
SHED_REQUESTS = Counter(
    "sits_shed_requests_total",
    "Requests the admission processor refused, by priority and reason.",
    ["priority", "reason"],
)


@dataclass
class ProcessorCounters:
    streams: int = 0
    admitted: int = 0
    admitted_locally: int = 0
    refused: int = 0
    shed: int = 0
    fail_open: int = 0
    not_inspected: int = 0
    last_refusal: str = ""
    refusals: list[str] = field(default_factory=list)

    def refuse(self, message: str) -> None:
        self.refused += 1
        self.last_refusal = message
        if len(self.refusals) < 100:
            self.refusals.append(message)


def _metadata_value(context: Any, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return str(value)
    return None


# Serialized once: building and serializing these pydantic messages per chunk costs ~70 µs.
_CONTINUE_HEADERS = ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse())).SerializeToString()
_CONTINUE_BODY = ProcessingResponse(request_body=BodyResponse(response=CommonResponse())).SerializeToString()


def _continue_headers() -> bytes:
    return _CONTINUE_HEADERS


def _continue_body() -> bytes:
    return _CONTINUE_BODY


def _serialize(response: ProcessingResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def local_reply(grpc_status: int, http_status: StatusCode, message: str) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=http_status),
            grpc_status=GrpcStatus(status=grpc_status),
            body=message.encode(),
            details=f"sits_admission_{'refused' if grpc_status == GRPC_RESOURCE_EXHAUSTED else 'shed'}",
        )
    )


def http_reply(status: int, code: str, message: str) -> ProcessingResponse:
    """A local reply on the HTTP path: Envoy's local_reply_config turns it into OpenAI's error JSON.

    `code` becomes the response detail, which that JSON carries as `error.code`.
    """
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=StatusCode(status)), body=message.encode(), details=code
        )
    )


class AdmissionProcessor:
    """One `Process` stream per HTTP request; decisions come from admission.py and the Admitter."""

    def __init__(
        self,
        policy: MeshPolicy,
        admitter: Admitter,
        pressure: PressureSource | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.policy = policy
        self.admitter = admitter
        self.pressure = pressure or NoPressure()
        self.counters = ProcessorCounters()
        self.recent_free_kv = RecentFreeKv(policy.admission, clock or SystemClock())
        tokenizer = policy.http.tokenizer_path
        self.count_tokens: TokenCounter = tokenizer_counter(tokenizer) if tokenizer else byte_count

    async def _verdict(self, query: AdmissionQuery) -> Verdict:
        if self.recent_free_kv.admits_locally(query):
            self.counters.admitted_locally += 1
            return Verdict(admitted=True, reason="small against recent free KV")
        try:
            verdict = await self.admitter.admit(query)
            self.recent_free_kv.remember(verdict)
            return verdict
        except AdmitterUnavailable as err:
            self.counters.fail_open += 1
            log.warning("admitter unavailable, using the fallback: %s", err)
            return fallback_verdict(query, self.policy.admission)

    async def process(
        self, requests: AsyncIterator[ExtProcRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse | bytes]:
        if self.policy.engine_api == "openai":
            async for response in self.process_openai(requests, context):
                yield response
            return
        self.counters.streams += 1
        # Without a header phase, the route names the priority in the stream's metadata.
        priority = priority_of(_metadata_value(context, PRIORITY_METADATA), self.policy.priorities)
        decided = False
        shed_checked = False
        body = bytearray()
        async for request in requests:
            if request.phase is Phase.REQUEST_HEADERS:
                path = request.header(":path") or ""
                priority = priority_of(request.header(self.policy.priorities.header), self.policy.priorities)
                inspect = path.split("?", 1)[0] == self.policy.admission.generate_path
                reason = shed_reason(priority, self.pressure.current(), self.policy.priorities)
                shed_checked = True
                if reason is not None:
                    self.counters.shed += 1
                    SHED_REQUESTS.labels(priority=priority, reason="pressure").inc()
                    yield local_reply(GRPC_UNAVAILABLE, StatusCode.ServiceUnavailable, reason)
                    return
                if not inspect:
                    self.counters.not_inspected += 1
                    decided = True
                yield _continue_headers()
            elif request.phase is Phase.REQUEST_BODY:
                if decided:
                    yield _continue_body()
                    continue
                if not shed_checked:
                    shed_checked = True
                    reason = shed_reason(priority, self.pressure.current(), self.policy.priorities)
                    if reason is not None:
                        self.counters.shed += 1
                        SHED_REQUESTS.labels(priority=priority, reason="pressure").inc()
                        yield local_reply(GRPC_UNAVAILABLE, StatusCode.ServiceUnavailable, reason)
                        return
                body += request.body
                if len(body) > MAX_BODY_BYTES:
                    message = refusal_message(
                        Verdict(
                            admitted=False,
                            reason=f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB and is not inspected",
                        )
                    )
                    self._count_kv_refusal(message, priority)
                    yield local_reply(GRPC_RESOURCE_EXHAUSTED, StatusCode.TooManyRequests, message)
                    return
                if not (frame_complete(body) or request.end_of_stream):
                    yield _continue_body()
                    continue
                decided = True
                try:
                    shape = parse_generate(body)
                except NotAGenerateRequest as err:
                    # The engine rejects what it cannot parse; nothing to protect here.
                    log.info("not inspected: %s", err)
                    self.counters.not_inspected += 1
                    yield _continue_body()
                    continue
                body.clear()
                refusal = await self._admission_refusal(shape, priority)
                if refusal is None:
                    yield _continue_body()
                else:
                    yield local_reply(GRPC_RESOURCE_EXHAUSTED, StatusCode.TooManyRequests, refusal)
                    return
            else:
                # Trailers or response phases are not requested; answer nothing we were not asked.
                continue

    async def _admission_refusal(self, shape: GenerateShape | OpenAIShape, priority: PriorityName) -> str | None:
        """Ask admission about one request on either API; the readable reason when it is refused."""
        verdict = await self._verdict(
            AdmissionQuery(shape.prompt_tokens, shape.max_tokens, priority, shape.prompt_logprobs)
        )
        if verdict.admitted:
            self.counters.admitted += 1
            return None
        message = refusal_message(verdict)
        self._count_kv_refusal(message, priority)
        return message

    def _count_kv_refusal(self, message: str, priority: PriorityName) -> None:
        self.counters.refuse(message)
        SHED_REQUESTS.labels(priority=priority, reason="kv_admission").inc()

    async def process_openai(
        self, requests: AsyncIterator[ExtProcRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse | bytes]:
        """One OpenAI request: Envoy sends its whole JSON body (BUFFERED), the route its tier and endpoint."""
        self.counters.streams += 1
        # The route's metadata is what Envoy routed by (the client's own headers are not): trusted first.
        # An Istio sidecar has no SITS routes and sends none, so the headers stand in there.
        routed_priority = _metadata_value(context, PRIORITY_METADATA)
        routed_endpoint = _metadata_value(context, OPENAI_ENDPOINT_METADATA)
        priority = priority_of(routed_priority, self.policy.priorities)
        endpoint: Endpoint = "chat" if routed_endpoint == "chat" else "completions"
        inspect = True
        body = bytearray()
        async for request in requests:
            if request.phase is Phase.REQUEST_HEADERS:
                if routed_priority is None:
                    priority = priority_of(request.header(self.policy.priorities.header), self.policy.priorities)
                if routed_endpoint is None:
                    path = (request.header(":path") or "").split("?", 1)[0]
                    inspect = path in OPENAI_PATHS.values()
                    endpoint = "chat" if path == OPENAI_PATHS["chat"] else "completions"
                    if not inspect:
                        self.counters.not_inspected += 1
                yield _continue_headers()
                continue
            if request.phase is not Phase.REQUEST_BODY:
                continue
            if not inspect:
                yield _continue_body()
                continue
            body += request.body
            limit = self.policy.http.max_body_bytes
            if len(body) > limit:
                # Envoy's own buffer limit may be higher (it takes the connection's when that is larger).
                message = f"the request body exceeds {limit} bytes"
                self.counters.refuse(message)
                yield http_reply(413, "sits_request_too_large", message)
                return
            if not request.end_of_stream:
                yield _continue_body()
                continue
            reason = shed_reason(priority, self.pressure.current(), self.policy.priorities)
            if reason is not None:
                self.counters.shed += 1
                SHED_REQUESTS.labels(priority=priority, reason="pressure").inc()
                yield http_reply(429, "sits_shed", reason)
                return
            try:
                shape = parse_openai(bytes(body), endpoint, self.policy.http, self.count_tokens)
            except OpenAIRequestError as err:
                self.counters.refuse(err.message)
                yield http_reply(err.status, f"sits_{err.code}", err.message)
                return
            refusal = await self._admission_refusal(shape, priority)
            if refusal is None:
                yield _continue_body()
            else:
                # 400, not 429: retrying the same prompt at once would be refused the same way.
                yield http_reply(400, "sits_kv_admission", refusal)
            return

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.process,
                    request_deserializer=decode_processing_request,
                    response_serializer=_serialize,
                )
            },
        )


class RuntimeWriter(Protocol):
    async def runtime_modify(self, values: dict[str, int | float | str]) -> None: ...


BYPASS_OPEN = Gauge(
    "sits_admission_bypass_open",
    "1 while Generate requests skip the admission processor because none could be refused.",
)


class BypassController:
    """Probes the decision service and tells Envoy whether Generate may skip the processor.

    The verdict on each probe also keeps the processor's recent free-KV figure
    fresh, so small requests are admitted locally the moment inspection resumes.
    A state Envoy has not confirmed is sent again on the next probe, and an open
    bypass is re-asserted every `reassert_s` in case Envoy restarted (its
    default is to inspect).
    """

    def __init__(
        self,
        processor: AdmissionProcessor,
        envoy: RuntimeWriter,
        clock: Clock | None = None,
        reassert_s: float = 2.0,
    ) -> None:
        self.processor = processor
        self.envoy = envoy
        self._clock = clock or SystemClock()
        policy = processor.policy
        self.gate = BypassGate(policy.admission, policy.priorities, self._clock)
        self._reassert_s = reassert_s
        self._told: bool | None = None
        self._told_at = float("-inf")
        self._write_failing = False
        self.transitions = 0

    async def probe_once(self) -> bool:
        try:
            verdict: Verdict | None = await self.processor.admitter.admit(self.gate.probe_query())
        except AdmitterUnavailable:
            verdict = None
        if verdict is not None:
            self.processor.recent_free_kv.remember(verdict)
        is_open = self.gate.observe(Probe(verdict, self.processor.pressure.current()))
        now = self._clock.monotonic()
        if is_open != self._told or (is_open and now - self._told_at >= self._reassert_s):
            try:
                await self.envoy.runtime_modify({ADMISSION_BYPASS_KEY: 100 if is_open else 0})
            except (OSError, EnvoyError) as err:
                if not self._write_failing:  # once per outage, not ten times a second
                    log.warning("could not set %s in Envoy: %s", ADMISSION_BYPASS_KEY, err)
                self._write_failing = True
                self._told = None
                return is_open
            self._write_failing = False
            if is_open != self._told:
                self.transitions += 1
                log.info("admission bypass %s: %s", "open" if is_open else "closed", self.gate.reason)
            self._told, self._told_at = is_open, now
            BYPASS_OPEN.set(1 if is_open else 0)
        return is_open

    async def run(self, stop: asyncio.Event) -> None:
        """Probes every `admission.bypass_check_interval_s` until `stop` is set."""
        interval_s = self.processor.policy.admission.bypass_check_interval_s
        while not stop.is_set():
            await self.probe_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


class ExtProcServer:
    """`async with ExtProcServer(processor, port=0) as server:` serves on 127.0.0.1:`server.port`."""

    def __init__(self, processor: AdmissionProcessor, host: str = "127.0.0.1", port: int = 0) -> None:
        self.processor = processor
        self.host = host
        self.port = port
        self._server: grpc.aio.Server | None = None

    async def __aenter__(self) -> ExtProcServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self.processor.handler(),))
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        await server.start()
        self._server = server

    async def stop(self, grace_s: float = 0.5) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                await server.stop(grace_s)


async def serve_admission(
    policy: MeshPolicy,
    admitter: Admitter,
    pressure: PressureSource,
    envoy: RuntimeWriter | None,
    stop: asyncio.Event,
    on_ready: Callable[[ExtProcServer], None] = lambda server: None,
) -> AdmissionProcessor:
    """Serves the processor, and the bypass probe when the policy asks for it, until `stop` is set."""
    processor = AdmissionProcessor(policy, admitter, pressure)
    async with ExtProcServer(processor, policy.admission.address, policy.admission.port) as server:
        probing = None
        if policy.admission.bypass_max_request_tokens and envoy is not None:
            probing = asyncio.create_task(BypassController(processor, envoy).run(stop))
        on_ready(server)
        await stop.wait()
        if probing is not None:
            await probing
    return processor
