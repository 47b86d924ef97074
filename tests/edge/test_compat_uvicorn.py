"""The uvicorn compatibility module: what it relies on exists in the installed uvicorn, and a
uvicorn without it stops the server from starting (with the reason) instead of serving without
the request-head limits."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxproxy.edge import _compat_uvicorn as compat
from mlxproxy.edge.limits import HeadGuard, HeadLimits
from support import fast_stack_installed


def test_every_internal_it_uses_exists_in_the_installed_uvicorn() -> None:
    assert compat.missing_internals() == [], f"uvicorn {uvicorn.__version__} (tested: {compat.TESTED})"
    assert compat.missing_internals("h11") == []
    classes = {"H11Protocol": H11Protocol}
    if fast_stack_installed():
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        classes["HttpToolsProtocol"] = HttpToolsProtocol
    for name, cls in classes.items():
        for attr in (*compat.PRIVATE_NAMES.get(name, ()), *compat.INTERNAL_NAMES[name]):
            assert callable(getattr(cls, attr, None)), f"{name}.{attr}"


def test_the_lists_name_what_the_module_uses() -> None:
    source = Path(compat.__file__).read_text(encoding="utf-8")
    for names in (*compat.PRIVATE_NAMES.values(), *compat.INTERNAL_NAMES.values()):
        for attr in names:
            assert f".{attr}(" in source or f"def {attr}(" in source, attr


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_the_protocol_classes_subclass_uvicorns_with_the_guard(http: str) -> None:
    if http == "h11":
        base: type = H11Protocol
    else:
        base = pytest.importorskip("uvicorn.protocols.http.httptools_impl").HttpToolsProtocol
    cls = compat.protocol_class(http, HeadLimits(max_count=7))
    assert issubclass(cls, HeadGuard) and issubclass(cls, base)


def test_a_uvicorn_without_an_internal_refuses_to_start_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(H11Protocol, "on_response_complete")
    assert compat.missing_internals("h11") == ["H11Protocol.on_response_complete"]
    with pytest.raises(RuntimeError, match=r"lacks H11Protocol\.on_response_complete.*tested: uvicorn"):
        compat.protocol_class("h11")
    if fast_stack_installed():  # the other stack's class is not affected
        assert compat.missing_internals("httptools") == []


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown HTTP protocol"):
        compat.protocol_class("h2")


class _Searched(bytes):
    """A buffer that records how far each search in it read: to the end of what it found, else
    to the end of the range searched."""

    reach: list[int]

    def find(self, sub: bytes, start: int = 0, end: int | None = None) -> int:  # type: ignore[override]
        at = super().find(sub, start, end)
        self.reach.append(at + len(sub) if at >= 0 else len(self) if end is None else end)
        return at


def test_the_end_of_a_request_head_is_found_without_reading_its_body() -> None:
    """The plain stack's check for bare LF and folded lines looks for the head's end in all that
    is buffered, an agent's 57 kB body included: a search through the body for an LF-only blank
    line cost ~50 us per request, more than h11's parse of the whole request."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 60000\r\n\r\n"
    buf = _Searched(head + b'{"messages": "' + b"x" * 59_984 + b'"}')
    buf.reach = []
    assert compat._head_end(buf) == len(head) - 2  # (the offset of the blank line's LF)
    assert max(buf.reach) <= len(head)


def test_the_end_of_a_request_head_is_the_first_blank_line_whatever_its_line_ends() -> None:
    def first_blank_line(buf: bytes) -> int:  # the definition: the earliest of either kind, or -1
        ends = [i for i in (buf.find(b"\n\r\n"), buf.find(b"\n\n")) if i >= 0]
        return min(ends) + 1 if ends else -1

    # every buffer of up to 7 bytes from the bytes that matter
    bufs = [bytes(p) for n in range(8) for p in itertools.product(b"\n\ra \t", repeat=n)]
    bufs += [b"GET / HTTP/1.1\nHost: x\n\nbody\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody\n\n"]
    for buf in bufs:
        assert compat._head_end(buf) == first_blank_line(buf), buf
