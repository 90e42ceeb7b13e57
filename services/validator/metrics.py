"""The validator's own Prometheus metrics (names are the contract in deploy/METRICS.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

VERDICTS = Counter("sits_verdicts_total", "Verdicts reached, by action kind and verdict.", ["kind", "verdict"])
ROLLBACKS = Counter("sits_rollbacks_total", "Rollback commands issued, by the kind of action rolled back.", ["kind"])
PENDING = Gauge("sits_validator_pending_actions", "Applied actions still inside their settle window.")
