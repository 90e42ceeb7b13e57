"""H200: where capture's NVML sampling CPU goes at 100 Hz (issue 3's unexplained share).

Usage: python -m scripts.gpu.capture_nvml_breakdown OUT_JSON [seconds] [hz]

Each variant runs for `seconds` and reports CPU % of one core; the thread variants count only
the sampling thread's own CPU (`time.thread_time`):

- `thread_sleep_only`: the sampling thread's loop with no work (the wake-up floor);
- `thread_read`: + `NvmlReader.read` with details every 10th tick (as NvmlSource);
- `thread_read_convert`: + `reading_to_sample` (protobuf) for each reading;
- `source`: the real `NvmlSource` consumed on an asyncio loop, split into its sampling thread and
  the rest of the process (loop wake-ups, deliveries, the consumer).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.gpu.capture_nvml_overhead import consume_source, thread_loop
from services.capture.sources.nvml import NvmlSource, reading_to_sample
from services.capture.sources.nvml_reader import NvmlReader


def thread_pct(work: Callable[[int], object], hz: float, seconds: float) -> float:
    run = thread_loop(work, hz, seconds)
    return 100.0 * float(run["cpu_s"]) / float(run["wall_s"])


class TimedSource(NvmlSource):
    thread_cpu_s = 0.0

    def _sample_until(self, *args: Any) -> None:
        started = time.thread_time()
        try:
            super()._sample_until(*args)
        finally:
            self.thread_cpu_s = time.thread_time() - started


def source_split(hz: float, seconds: float) -> dict[str, float]:
    source = TimedSource(hz=hz, reader=NvmlReader())
    run = consume_source(source, seconds)
    cpu, wall = run["cpu_s"], run["wall_s"]
    return {
        "process_pct": 100.0 * cpu / wall,
        "sampling_thread_pct": 100.0 * source.thread_cpu_s / wall,
        "rest_of_process_pct": 100.0 * (cpu - source.thread_cpu_s) / wall,
    }


def main() -> int:
    out_path = Path(sys.argv[1])
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    hz = float(sys.argv[3]) if len(sys.argv) > 3 else 100.0
    details_every = 10
    reader = NvmlReader()
    reader.open()
    result: dict[str, Any] = {"hz": hz, "seconds": seconds, "gpus": reader.gpu_count}
    result["thread_sleep_only"] = thread_pct(lambda tick: None, hz, seconds)
    result["thread_read"] = thread_pct(lambda tick: reader.read(details=tick % details_every == 0), hz, seconds)

    def read_convert(tick: int) -> None:
        for reading in reader.read(details=tick % details_every == 0):
            reading_to_sample(reading, host="h200")

    result["thread_read_convert"] = thread_pct(read_convert, hz, seconds)
    reader.close()
    result["source"] = source_split(hz, seconds)
    print(json.dumps(result, indent=2))
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
