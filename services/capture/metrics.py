"""Capture's own Prometheus metrics (beside sits.runtime.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

SOURCE_HEALTHY = Gauge("sits_capture_source_healthy", "1 while a capture source is healthy.", ["source"])
SOURCE_ERRORS = Counter("sits_capture_source_errors_total", "Failed reads, by capture source.", ["source"])
SAMPLES = Counter("sits_capture_samples_total", "Samples taken, by capture source.", ["source"])
OOM_REPORTS = Counter("sits_capture_oom_reports_total", "ReportOom calls, by outcome.", ["outcome"])
SPOOL_PENDING = Gauge("sits_capture_spool_pending", "Events waiting in the on-disk spool.")
SPOOL_BYTES = Gauge("sits_capture_spool_bytes", "Bytes in the on-disk spool.")
SPOOL_DROPPED = Counter(
    "sits_capture_spool_dropped_samples_total", "Metric samples dropped (oldest first) to keep the spool bounded."
)
SPOOLED = Counter("sits_capture_spooled_total", "Events written to the spool because Kafka was unreachable.", ["kind"])
DRAINED = Counter("sits_capture_spool_drained_total", "Spooled events published after the broker returned.")
BROKER_UP = Gauge("sits_capture_broker_up", "1 while capture can publish to Kafka.")
STREAM_CLIENTS = Gauge("sits_capture_stream_clients", "Open StreamSamples clients.")
STREAM_CUT = Counter("sits_capture_stream_cut_total", "StreamSamples clients closed for being too slow.")
