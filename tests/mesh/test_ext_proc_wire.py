"""The ext_proc request decoder against envoy-data-plane's own encoder."""

from __future__ import annotations

import pytest
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import Struct, Value
from hypothesis import given
from hypothesis import strategies as st

from sits_mesh.ext_proc_wire import Phase, WireError, decode_processing_request


def _headers_request(pairs: list[tuple[str, str]], raw: bool = True, **extra: object) -> bytes:
    values = [HeaderValue(key=k, raw_value=v.encode()) if raw else HeaderValue(key=k, value=v) for k, v in pairs]
    message = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values)), **extra)  # type: ignore[arg-type]
    return bytes(message.SerializeToString())


def test_request_headers_with_the_fields_envoy_adds_around_them() -> None:
    data = _headers_request(
        [(":path", "/vllm.grpc.engine.VllmEngine/Generate"), ("X-Sits-Priority", "p2"), ("te", "trailers")],
        metadata_context=Metadata(filter_metadata={"sits": Struct(fields={"tier": Value(string_value="p2")})}),
        observability_mode=True,
        protocol_config=ProtocolConfiguration(send_body_without_waiting_for_header_response=True),
    )
    decoded = decode_processing_request(data)
    assert decoded.phase is Phase.REQUEST_HEADERS
    assert decoded.header(":path") == "/vllm.grpc.engine.VllmEngine/Generate"
    assert decoded.header("x-sits-priority") == "p2"
    assert decoded.header("te") == "trailers"
    assert decoded.header("absent") is None


def test_value_and_raw_value_both_read_and_the_first_of_a_repeated_name_wins() -> None:
    decoded = decode_processing_request(_headers_request([("a", "one"), ("a", "two")], raw=False))
    assert decoded.headers == {"a": "one"}


@pytest.mark.parametrize("end_of_stream", [False, True])
def test_request_body_chunk(end_of_stream: bool) -> None:
    chunk = b"\x00\x00\x00\x00\x05hello" + bytes(range(256))
    data = ProcessingRequest(request_body=HttpBody(body=chunk, end_of_stream=end_of_stream)).SerializeToString()
    decoded = decode_processing_request(bytes(data))
    assert decoded.phase is Phase.REQUEST_BODY
    assert decoded.body == chunk
    assert decoded.end_of_stream is end_of_stream


def test_other_phases_are_named_other() -> None:
    for message in (
        ProcessingRequest(response_headers=HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key="a", value="b")]))),
        ProcessingRequest(response_body=HttpBody(body=b"x")),
        ProcessingRequest(request_trailers=HttpTrailers()),
        ProcessingRequest(),
    ):
        assert decode_processing_request(bytes(message.SerializeToString())).phase is Phase.OTHER


def test_truncated_or_garbled_bytes_are_a_wire_error() -> None:
    data = _headers_request([(":path", "/x")])
    for bad in (data[:-1], data[:3], b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0f"):
        with pytest.raises(WireError):
            decode_processing_request(bad)


header_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-:0123456789", min_size=1, max_size=24)
header_values = st.text(max_size=64).filter(lambda v: "\x00" not in v)


@given(st.lists(st.tuples(header_names, header_values), max_size=16), st.booleans())
def test_any_header_list_decodes_as_envoy_data_plane_reads_it(pairs: list[tuple[str, str]], raw: bool) -> None:
    data = _headers_request(pairs, raw=raw)
    decoded = decode_processing_request(data)
    oracle = ProcessingRequest.FromString(data)
    assert oracle.request_headers is not None and oracle.request_headers.headers is not None
    expected: dict[str, str] = {}
    for header in oracle.request_headers.headers.headers:
        expected.setdefault(header.key.lower(), header.value or header.raw_value.decode(errors="replace"))
    assert decoded.headers == expected


@given(st.binary(max_size=4096), st.booleans())
def test_any_body_chunk_decodes_byte_for_byte(chunk: bytes, end_of_stream: bool) -> None:
    data = bytes(ProcessingRequest(request_body=HttpBody(body=chunk, end_of_stream=end_of_stream)).SerializeToString())
    decoded = decode_processing_request(data)
    assert (decoded.phase, decoded.body, decoded.end_of_stream) == (Phase.REQUEST_BODY, chunk, end_of_stream)
