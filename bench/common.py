"""The benchmarks' result format lives in `sits.results` (the demo records its run with it too)."""

from sits.results import RESULTS, machine, median, quantile, write_result

__all__ = ["RESULTS", "machine", "median", "quantile", "write_result"]
