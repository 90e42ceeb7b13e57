"""Wiring of the capture service: settings, sources, spool, Kafka publisher, gRPC.

Run: `python -m services.capture.main` (or the CLI's capture subcommand).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from services.capture.grpc_api import MUTATING_METHODS, binding
from services.capture.publisher import CapturePublisher, TopicEnsuringProducer
from services.capture.service import CaptureService
from services.capture.settings import CaptureSettings
from services.capture.sources.configured import build_sources
from services.capture.spool import Spool
from sits.runtime.clock import SystemClock
from sits.runtime.lifecycle import run_service
from sits.runtime.service import ServiceApp

SETTINGS = CaptureSettings


async def serve(settings: CaptureSettings, stop: asyncio.Event | None = None) -> None:
    async with ServiceApp("capture", settings, stop) as app:
        spool = Spool(
            settings.capture_spool_dir,
            max_bytes=settings.capture_spool_max_bytes,
            fsync=settings.capture_spool_fsync,
            fsync_interval_s=settings.capture_spool_fsync_interval_s,
        )

        def close_spool() -> None:
            with contextlib.suppress(Exception):
                spool.close()

        app.on_close(close_spool)
        # Its own producer, not the app's: capture starts (and spools) while Kafka is down.
        publisher = CapturePublisher(
            lambda: TopicEnsuringProducer(settings),
            spool,
            app.topics,
            batch_size=settings.capture_publish_batch,
            trace_samples_above=settings.capture_trace_samples_above,
            linger_s=settings.capture_linger_ms / 1000,
            urgent_lane=settings.capture_urgent_lane,
        )
        service = CaptureService(
            publisher,
            SystemClock(),
            stream_buffer=settings.capture_stream_buffer,
            max_targets=settings.capture_max_targets,
        )
        for source in build_sources(settings):
            service.add_source(source)
        await app.grpc([binding(service)], addr=settings.capture_addr, mutating_methods=MUTATING_METHODS)
        work = [publisher.run(app.stop), service.export_health(app.stop)]
        if settings.oom_hook_spool_dir is not None:
            work.append(service.watch_hook_spool(settings.oom_hook_spool_dir, settings.oom_hook_spool_scan_s, app.stop))
        # Sources wait on their own clocks and streams; cancelling them is how they stop.
        await app.run(*work, background=[service.run_source(s, app.stop) for s in service.sources.values()])


def main() -> int:
    return run_service("capture", CaptureSettings, serve)


if __name__ == "__main__":
    sys.exit(main())
