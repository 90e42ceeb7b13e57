"""sits.v1.Capture over gRPC: StreamSamples, ReportOom, GetSnapshot."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.capture import metrics
from services.capture.domain import matches
from services.capture.service import CaptureService, RejectedOom
from sits.runtime.fanout import SubscriberTooSlow
from sits.runtime.grpcserver import ServiceBinding, abort_invalid
from sits.v1 import capture_pb2, capture_pb2_grpc, events_pb2

Context = grpc.aio.ServicerContext[Any, Any]


class CaptureApi(capture_pb2_grpc.CaptureServicer):
    def __init__(self, service: CaptureService) -> None:
        self._service = service

    async def StreamSamples(
        self, request: capture_pb2.StreamSamplesRequest, context: Context
    ) -> AsyncIterator[events_pb2.MetricSample]:
        selector = request.filter
        subscription = self._service.fanout.subscribe(lambda s: matches(selector, s.meta.target))
        metrics.STREAM_CLIENTS.inc()
        try:
            async for sample in subscription:
                yield sample
        except SubscriberTooSlow as exc:
            metrics.STREAM_CUT.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            metrics.STREAM_CLIENTS.dec()

    async def ReportOom(self, request: events_pb2.OomEvent, context: Context) -> capture_pb2.ReportOomResponse:
        try:
            event_id = self._service.report_oom(request)
        except RejectedOom as exc:
            await abort_invalid(context, f"OomEvent refused: {exc}")
            raise AssertionError("unreachable") from exc  # abort raises
        return capture_pb2.ReportOomResponse(event_id=event_id)

    async def GetSnapshot(self, request: capture_pb2.GetSnapshotRequest, context: Context) -> capture_pb2.Snapshot:
        snapshot = self._service.snapshot(request.target)
        if snapshot is None:
            t = request.target
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no samples yet for target host={t.host!r} gpu_uuid={t.gpu_uuid!r} engine={t.engine!r}",
            )
            raise AssertionError("unreachable")
        return snapshot


# ReportOom starts healing (streams may be aborted because of it): only callers with the token.
MUTATING_METHODS = ("/sits.v1.Capture/ReportOom",)


def binding(service: CaptureService) -> ServiceBinding:
    return ServiceBinding(
        capture_pb2_grpc.add_CaptureServicer_to_server,
        CaptureApi(service),
        capture_pb2.DESCRIPTOR.services_by_name["Capture"].full_name,
    )
