"""Inference load of mixed priority against vLLM's gRPC API or its OpenAI HTTP API (through Envoy or direct).

Open-loop arrivals at a rate that follows a schedule (requests per second over
time), each request a streaming `Generate` (or, on the HTTP path, a streaming
chat completion) carrying its tier in the `x-sits-priority` header. In-flight
requests are capped so the driver itself stays bounded when the server stops
answering. HTTP answers are recorded under the gRPC status names the report
counts: 429 and an admission refusal as RESOURCE_EXHAUSTED, 503 as UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

PRIORITY_HEADER = "x-sits-priority"
# Each tier's share of the arrivals.
DEFAULT_MIX = {"P0": 0.2, "P1": 0.3, "P2": 0.5}
# An arrival the driver reaches this late is dropped (counted in `behind`) rather than sent in a burst.
MAX_LAG_S = 1.0


@dataclass(frozen=True)
class RequestOutcome:
    priority: str
    started: float
    ttft_s: float | None
    finished: float
    tokens: int
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"


@dataclass(frozen=True)
class LoadShape:
    """Requests per second at each moment, and the request sizes."""

    rate: Callable[[float], float]
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    prompt_tokens: tuple[int, int] = (32, 96)
    max_tokens: tuple[int, int] = (24, 64)


def ramp(base_rps: float, peak_factor: float, ramp_s: float, hold_s: float) -> Callable[[float], float]:
    """Base load for a fifth of the ramp, then a linear climb to peak, held until the end."""
    warm = ramp_s * 0.2

    def rate(t: float) -> float:
        if t < warm:
            return base_rps
        if t < ramp_s:
            return base_rps * (1.0 + (peak_factor - 1.0) * (t - warm) / (ramp_s - warm))
        return base_rps * peak_factor if t < ramp_s + hold_s else 0.0

    return rate


def generate_request(
    prompt_tokens: int, max_tokens: int, priority: str = "P1", vocab: int = 512
) -> vllm_engine_pb2.GenerateRequest:
    # vLLM's gRPC server does not pass call metadata into the engine: the tier also travels in the
    # request id, which is how the SITS scheduler picks what to preempt or abort first.
    request = vllm_engine_pb2.GenerateRequest(request_id=f"{priority.lower()}-{uuid.uuid4().hex}", stream=True)
    request.tokenized.input_ids.extend(random.randrange(1, vocab) for _ in range(prompt_tokens))
    request.sampling_params.max_tokens = max_tokens
    request.sampling_params.temperature = 0.0
    request.sampling_params.ignore_eos = True
    return request


async def one_request(
    stub: vllm_engine_pb2_grpc.VllmEngineStub,
    priority: str,
    prompt_tokens: int,
    max_tokens: int,
    timeout_s: float = 60.0,
    extra_metadata: tuple[tuple[str, str], ...] = (),
) -> RequestOutcome:
    started = time.monotonic()
    ttft: float | None = None
    tokens = 0
    call = stub.Generate(
        generate_request(prompt_tokens, max_tokens, priority),
        metadata=((PRIORITY_HEADER, priority), *extra_metadata),
        timeout=timeout_s,
    )
    try:
        async for response in call:
            if response.HasField("chunk"):
                if ttft is None:
                    ttft = time.monotonic() - started
                tokens += len(response.chunk.token_ids)
    except grpc.aio.AioRpcError as err:
        return RequestOutcome(priority, started, ttft, time.monotonic(), tokens, err.code().name, err.details() or "")
    return RequestOutcome(priority, started, ttft, time.monotonic(), tokens, "OK")


# The HTTP path's prompts: words the served tokenizer knows, about one token each.
_WORDS = ("memory", "engine", "token", "stream", "cache", "queue")


def http_status(code: int, body: bytes) -> str:
    """An HTTP answer under the gRPC status name the report counts it by."""
    if code == 200:
        return "OK"
    if code == 429 or (code == 400 and b"sits_kv_admission" in body):
        return "RESOURCE_EXHAUSTED"
    if code == 503:
        return "UNAVAILABLE"
    return f"HTTP_{code}"


async def one_http_request(
    client: httpx.AsyncClient,
    model: str,
    priority: str,
    prompt_tokens: int,
    max_tokens: int,
    timeout_s: float = 60.0,
) -> RequestOutcome:
    """One streaming chat completion; TTFT at the first event that carries content."""
    started = time.monotonic()
    ttft: float | None = None
    tokens = 0
    body = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(random.choice(_WORDS) for _ in range(prompt_tokens))}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
    }
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={PRIORITY_HEADER: priority.lower()}, timeout=timeout_s
        ) as response:
            if response.status_code != 200:
                text = await response.aread()
                status = http_status(response.status_code, text)
                return RequestOutcome(priority, started, None, time.monotonic(), 0, status, text[:300].decode())
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                with contextlib.suppress(ValueError, LookupError, TypeError, AttributeError):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
                    delta = event["choices"][0]["delta"] if event.get("choices") else {}
                    # The first event names the role only; a token's text may be empty (a special token).
                    if "content" in delta and "role" not in delta:
                        ttft = time.monotonic() - started if ttft is None else ttft
    except httpx.HTTPError as err:
        return RequestOutcome(priority, started, ttft, time.monotonic(), tokens, "UNAVAILABLE", str(err)[:300])
    return RequestOutcome(priority, started, ttft, time.monotonic(), tokens, "OK")


def rate_between(series: list[list[float]], start_s: float, end_s: float) -> float:
    """Events per second in [start_s, end_s) over sorted lists of event times."""
    if end_s <= start_s:
        return 0.0
    count = sum(bisect.bisect_left(times, end_s) - bisect.bisect_left(times, start_s) for times in series)
    return count / (end_s - start_s)


class LoadDriver:
    """`api="openai"` drives the HTTP path (chat completions for `model`), else vLLM's gRPC `Generate`."""

    def __init__(
        self,
        address: str,
        shape: LoadShape,
        max_in_flight: int = 96,
        seed: int = 7,
        api: str = "grpc",
        model: str = "",
    ) -> None:
        self._address = address
        self._api = api
        self._model = model
        self._shape = shape
        self._max_in_flight = max_in_flight
        self._random = random.Random(seed)
        self.outcomes: list[RequestOutcome] = []
        self.in_flight = 0
        # Arrivals not sent because `max_in_flight` were in flight; not sent because the driver was more than
        # MAX_LAG_S behind their time.
        self.refused_locally = 0
        self.behind = 0
        # When each sent arrival was due, in seconds from the start of `run`.
        self.sent_at: list[float] = []
        self.on_outcome: Callable[[RequestOutcome], None] | None = None

    @property
    def sent(self) -> int:
        return len(self.sent_at)

    def sent_rate(self, start_s: float, end_s: float) -> float:
        """Arrivals sent per second that were due between `start_s` and `end_s` after the start of `run`."""
        return rate_between([self.sent_at], start_s, end_s)

    def _pick_priority(self) -> str:
        roll = self._random.random() * sum(self._shape.mix.values())
        for priority, weight in self._shape.mix.items():
            roll -= weight
            if roll <= 0:
                return priority
        return next(iter(self._shape.mix))

    async def run(self, duration_s: float, stop: asyncio.Event | None = None) -> list[RequestOutcome]:
        stop = stop or asyncio.Event()
        began = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()
        async with contextlib.AsyncExitStack() as resources:
            if self._api == "openai":
                limits = httpx.Limits(
                    max_connections=self._max_in_flight, max_keepalive_connections=self._max_in_flight
                )
                stub: Any = await resources.enter_async_context(
                    httpx.AsyncClient(base_url=f"http://{self._address}", limits=limits)
                )
            else:
                channel = await resources.enter_async_context(grpc.aio.insecure_channel(self._address))
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            # Arrivals keep to their own clock: each is due a random gap after the one before it was due, not
            # after the driver woke up. Sleeping a gap after each wake-up offered a quarter of the rate asked
            # for (a demo on 2026-12-07: 64 requests/s asked, 10-17 sent) while the event loop was busy with
            # the streams; late arrivals now go out at once, and only those further behind than
            # MAX_LAG_S are dropped (counted), so a stalled driver does not burst.
            due = began
            while not stop.is_set():
                rate = self._shape.rate(due - began)
                if rate <= 0:
                    due += 0.05
                else:
                    due += self._random.expovariate(rate)
                if due - began >= duration_s:
                    break
                late = time.monotonic() - due
                if late < 0:
                    await asyncio.sleep(-late)
                else:
                    await asyncio.sleep(0)  # let the requests already issued start
                if rate <= 0:
                    continue
                if late > MAX_LAG_S:
                    self.behind += 1
                    continue
                if self.in_flight >= self._max_in_flight:
                    self.refused_locally += 1
                    continue
                self.sent_at.append(due - began)
                task = asyncio.create_task(self._issue(stub))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=60)
        return self.outcomes

    async def _issue(self, stub: Any) -> None:
        self.in_flight += 1
        try:
            priority = self._pick_priority()
            prompt_tokens = self._random.randint(*self._shape.prompt_tokens)
            max_tokens = self._random.randint(*self._shape.max_tokens)
            if self._api == "openai":
                outcome = await one_http_request(stub, self._model, priority, prompt_tokens, max_tokens)
            else:
                outcome = await one_request(stub, priority, prompt_tokens, max_tokens)
        finally:
            self.in_flight -= 1
        self.outcomes.append(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
