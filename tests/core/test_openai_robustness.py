"""Request parsing and usage injection (`core/openai.py`) never raise, on any JSON or any bytes
(property-based, hypothesis)."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxproxy.core.openai import inject_include_usage, is_injected_usage_chunk, parse_request

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["model", "stream", "stream_options", "messages", "prompt", "max_tokens", "x"]),
        json_values,
        max_size=6,
    ),
    st.sampled_from([b"", b" ", b"\n"]),
)
def test_request_parsing_and_usage_injection_never_raise(obj: dict, trailer: bytes) -> None:
    body = orjson.dumps(obj) + trailer
    info, parsed = parse_request("POST", "/v1/chat/completions", body)
    assert parsed == obj and info.json_body
    injected = orjson.loads(inject_include_usage(body, obj))
    assert injected["stream_options"]["include_usage"] is True
    assert {k: v for k, v in injected.items() if k != "stream_options"} == {
        k: v for k, v in obj.items() if k != "stream_options"
    }


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_request_parsing_never_raises_on_any_bytes(body: bytes) -> None:
    info, parsed = parse_request("POST", "/v1/chat/completions", body)
    assert parsed is None or isinstance(parsed, dict)
    assert is_injected_usage_chunk(body.decode("utf-8", "replace")) in (True, False)
