"""The benchmarks' result format lives in `sits_app.results` (the demo records its run with it too)."""

from sits_app.results import RESULTS, machine, median, quantile, utc_stamp, write_result

__all__ = ["RESULTS", "machine", "median", "quantile", "utc_stamp", "write_result"]
