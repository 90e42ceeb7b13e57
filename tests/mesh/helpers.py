"""Clients and peers for the mesh's live tests: a gRPC Generate client, a raw HTTP/2
client that can stop reading, and a small real Decision server with a KV rule."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from sits.v1 import decision_pb2, decision_pb2_grpc
from sits_mesh.admission import kv_reason
from sits_mesh.envoy_process import validate_config
from sits_mesh.policy import MeshPolicy

GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"
_ids = itertools.count()

# The test model (tests/mesh/conftest.py): 2 layers, 2 KV heads, head_dim 64, bf16.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2


def generate_request(
    prompt_tokens: int = 8, max_tokens: int = 8, logprobs: int | None = None
) -> vllm_engine_pb2.GenerateRequest:
    params = vllm_engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    if logprobs is not None:
        params.logprobs = logprobs
    return vllm_engine_pb2.GenerateRequest(
        request_id=f"mesh-test-{next(_ids)}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[(i % 400) + 1 for i in range(prompt_tokens)]),
        sampling_params=params,
        stream=True,
    )


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    chunks: int = 0
    finish_reason: str = ""
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK and self.finish_reason != ""


async def read_stream(call: grpc.aio.UnaryStreamCall[object, vllm_engine_pb2.GenerateResponse]) -> StreamResult:
    result = StreamResult()
    try:
        while (reply := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            assert isinstance(reply, vllm_engine_pb2.GenerateResponse)
            if reply.HasField("chunk"):
                result.chunks += 1
                result.tokens.extend(reply.chunk.token_ids)
            elif reply.HasField("complete"):
                result.finish_reason = reply.complete.finish_reason
    except grpc.aio.AioRpcError as err:
        result.code = err.code()
        result.details = err.details() or ""
        metadata: Any = err.trailing_metadata() or ()
        result.trailers = {str(key): str(value) for key, value in metadata}
    return result


async def generate(
    address: str,
    priority: str = "p0",
    prompt_tokens: int = 8,
    max_tokens: int = 8,
    metadata: tuple[tuple[str, str], ...] = (),
    timeout_s: float = 60.0,
) -> StreamResult:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        call = stub.Generate(
            generate_request(prompt_tokens, max_tokens),
            metadata=(("x-sits-priority", priority), *metadata),
            timeout=timeout_s,
        )
        return await read_stream(call)


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class SlowReader:
    """A raw HTTP/2 client that opens one Generate stream and acknowledges data only when told.

    The client's stream window is `window` bytes: without WINDOW_UPDATEs from
    us, Envoy may send no more than that; everything else must wait in Envoy
    (bounded by its buffer limits) or upstream.
    """

    def __init__(self, address: str, window: int) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.window = window
        self.received = 0
        self.acknowledged = 0
        self.trailers: dict[str, str] = {}
        self.ended = False
        self.tail = b""
        self.events: list[str] = []
        self._unacknowledged = 0
        self._stream_id = 0
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self._conn = h2.connection.H2Connection(config=config)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self, request: vllm_engine_pb2.GenerateRequest, priority: str = "p0") -> None:
        headers = [("content-type", "application/grpc"), ("te", "trailers"), ("x-sits-priority", priority)]
        await self.post(GENERATE_PATH, headers, grpc_frame(request.SerializeToString()))

    async def post(self, path: str, headers: list[tuple[str, str]], body: bytes) -> None:
        """Open one POST stream (HTTP/2, prior knowledge) and send the whole body."""
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window}
        )
        self._conn.initiate_connection()
        self._stream_id = self._conn.get_next_available_stream_id()
        self._conn.send_headers(
            self._stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", f"{self.host}:{self.port}"),
                *headers,
            ],
        )
        self._conn.send_data(self._stream_id, body, end_stream=True)
        await self._flush()

    async def _flush(self) -> None:
        assert self._writer is not None
        self._writer.write(self._conn.data_to_send())
        await self._writer.drain()

    async def pump(self, duration_s: float, acknowledge: bool) -> None:
        """Read frames for up to `duration_s` (less once the stream ended)."""
        assert self._reader is not None
        if acknowledge and self._unacknowledged:
            self._conn.acknowledge_received_data(self._unacknowledged, self._stream_id)
            self.acknowledged += self._unacknowledged
            self._unacknowledged = 0
            await self._flush()
        deadline = time.monotonic() + duration_s
        while not self.ended and (left := deadline - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(self._reader.read(65536), timeout=min(left, 0.2))
            except TimeoutError:
                continue
            if not data:
                self.events.append("connection closed")
                self.ended = True
                break
            for event in self._conn.receive_data(data):
                if not isinstance(event, h2.events.DataReceived):
                    self.events.append(repr(event)[:300])
                if isinstance(event, h2.events.DataReceived):
                    self.received += len(event.data)
                    self.tail = (self.tail + event.data)[-256:]
                    if acknowledge:
                        self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        self.acknowledged += event.flow_controlled_length
                    else:
                        self._unacknowledged += event.flow_controlled_length
                elif isinstance(event, h2.events.TrailersReceived):
                    self.trailers = {str(k): str(v) for k, v in event.headers}
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended = True
            await self._flush()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()


class KvRuleDecision(decision_pb2_grpc.DecisionServicer):
    """A test peer for sits.v1.Decision/Admit: fits when (prompt + max_tokens) KV <= free KV."""

    def __init__(self, free_kv_bytes: int) -> None:
        self.free_kv_bytes = free_kv_bytes
        self.calls: list[decision_pb2.AdmitRequest] = []

    async def Admit(
        self, request: decision_pb2.AdmitRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> decision_pb2.AdmitResponse:
        self.calls.append(request)
        needed = (request.prompt_tokens + request.max_tokens) * KV_BYTES_PER_TOKEN
        admitted = needed <= self.free_kv_bytes
        reason = "" if admitted else kv_reason(needed, self.free_kv_bytes, request.prompt_tokens, request.max_tokens)
        return decision_pb2.AdmitResponse(
            admitted=admitted, reason=reason, kv_bytes_needed=needed, kv_bytes_free=self.free_kv_bytes
        )

    # The mesh only calls Admit; the rest of the service is not this peer's job.
    async def Evaluate(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "test peer: Admit only")

    async def GetPolicy(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "test peer: Admit only")

    async def PutPolicy(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "test peer: Admit only")

    async def Explain(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "test peer: Admit only")


async def wait_for_stat(envoy: object, name: str, at_least: int, timeout_s: float = 20.0) -> int:
    from sits_mesh.envoy_process import EnvoyProcess

    assert isinstance(envoy, EnvoyProcess)
    deadline = time.monotonic() + timeout_s
    value = await envoy.stat(name)
    while value < at_least and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        value = await envoy.stat(name)
    return value


UPSTREAM_PAUSES = "cluster.vllm_p0.upstream_flow_control_paused_reading_total"
UPSTREAM_READ_BYTES = "cluster.vllm_p0.upstream_cx_rx_bytes_total"


async def stall_until_envoy_pauses(envoy: Any, reader: SlowReader, timeout_s: float = 120.0) -> tuple[int, int]:
    """Read without acknowledging until Envoy pauses reading from vLLM: (pauses, bytes Envoy read from vLLM)."""
    paused = 0
    # Seconds normally; generous because the shared CI machine can be very slow.
    deadline = time.monotonic() + timeout_s
    while paused < 1 and time.monotonic() < deadline:
        await reader.pump(0.3, acknowledge=False)
        paused = await envoy.stat(UPSTREAM_PAUSES)
    return paused, await envoy.stat(UPSTREAM_READ_BYTES)


async def upstream_read_once_settled(envoy: Any, reader: SlowReader, settle_s: float = 30.0) -> tuple[int, int]:
    """Bytes Envoy read from vLLM before and after the last second of a still-stalled client.

    What vLLM had already sent into its stream window can still land after the first pause (a slow
    engine sends it over seconds), so this waits, up to `settle_s`, for a whole second with nothing
    read; the two are equal once it came.
    """
    read_while_paused = await envoy.stat(UPSTREAM_READ_BYTES)
    settle_by = time.monotonic() + settle_s
    while True:
        await reader.pump(1.0, acknowledge=False)
        read_now = await envoy.stat(UPSTREAM_READ_BYTES)
        if read_now == read_while_paused or time.monotonic() > settle_by:
            return read_while_paused, read_now
        read_while_paused = read_now


def policy_with_pressure_file(data: dict[str, Any], tmp_path: Path) -> MeshPolicy:
    """A policy from `data` whose overload pressure file exists (Envoy's validate insists on it)."""
    pressure = tmp_path / "gpu_pressure"
    pressure.write_text("0")
    return MeshPolicy.model_validate({**data, "overload": {"pressure_file": str(pressure)}})


def manager_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The listener's HTTP connection manager config in a rendered bootstrap."""
    manager: dict[str, Any] = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return manager


def apply_bootstrap_patches(bootstrap: dict[str, Any], clusters: dict[str, Any]) -> None:
    """Merge the Istio cluster resource's BOOTSTRAP patches into `bootstrap`, as the sidecar would."""
    for patch in clusters["spec"]["configPatches"]:
        if patch["applyTo"] == "BOOTSTRAP":
            bootstrap.update(patch["patch"]["value"])


def envoy_validate(config_yaml: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate` of `config_yaml`, written to tmp_path/envoy.yaml; the caller checks the result."""
    path = tmp_path / "envoy.yaml"
    path.write_text(config_yaml)
    return validate_config(path)
