"""The demo's HTTP load: answers are counted under the status names the report reads."""

from __future__ import annotations

from sits_app.demo.load import http_status
from sits_app.demo.report import REFUSED


def test_shedding_overload_and_admission_refusals_count_as_refused_and_the_rest_as_failures() -> None:
    assert http_status(200, b"") == "OK"
    assert http_status(429, b'{"error": {"code": "sits_shed"}}') in REFUSED
    assert http_status(503, b"") in REFUSED
    assert http_status(400, b'{"error": {"code": "sits_kv_admission"}}') in REFUSED
    assert http_status(400, b'{"error": {"code": "sits_invalid_json"}}') == "HTTP_400"
    assert http_status(500, b"") == "HTTP_500"
