"""Capture test fixtures: a real capture service (gRPC on port 0, publisher to the session broker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.capture.grpc_api import binding
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.spool import Spool
from sits.runtime.clock import SystemClock
from sits.runtime.events import Topics
from sits.runtime.grpcserver import GrpcServer
from sits.runtime.settings import Settings
from sits.v1 import capture_pb2_grpc


@dataclass
class RunningCapture:
    service: CaptureService
    publisher: CapturePublisher
    server: GrpcServer
    stub: capture_pb2_grpc.CaptureAsyncStub
    stop: asyncio.Event


@pytest.fixture
def stream_buffer() -> int:
    return 64


@pytest.fixture
async def capture(settings: Settings, tmp_path: Path, stream_buffer: int) -> AsyncIterator[RunningCapture]:
    publisher = CapturePublisher(
        lambda: TopicEnsuringProducer(settings), Spool(tmp_path / "spool"), Topics(settings.topic_prefix)
    )
    service = CaptureService(publisher, SystemClock(), stream_buffer=stream_buffer)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    async with GrpcServer([binding(service)], port=0) as server, grpc.aio.insecure_channel(server.address) as channel:
        stub = capture_pb2_grpc.CaptureStub(channel)
        yield RunningCapture(service, publisher, server, stub, stop)
    stop.set()
    await asyncio.wait_for(task, 15)
