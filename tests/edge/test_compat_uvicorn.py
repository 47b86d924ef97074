"""The uvicorn compatibility module: what it relies on exists in the installed uvicorn, and a
uvicorn without it stops the server from starting (with the reason) instead of serving without
the request-head limits."""

from __future__ import annotations

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
