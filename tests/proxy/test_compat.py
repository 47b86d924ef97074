"""The aiohttp compatibility module: what it relies on exists in the installed aiohttp, and its
fallback to public API works."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp.client_proto import ResponseHandler

from mlxproxy.proxy import _compat_aiohttp as compat_aiohttp


def test_every_aiohttp_internal_it_uses_exists_in_the_installed_aiohttp() -> None:
    async def check() -> None:
        loop = asyncio.get_running_loop()
        assert compat_aiohttp.missing_internals(loop) == [], f"aiohttp {aiohttp.__version__}"
        conn = aiohttp.TCPConnector(limit=1)
        try:
            for name in compat_aiohttp.PRIVATE_NAMES["TCPConnector"]:
                assert hasattr(conn, name), name
        finally:
            await conn.close()
        handler = ResponseHandler(loop)
        for name in compat_aiohttp.PRIVATE_NAMES["ResponseHandler"]:
            assert hasattr(handler, name), name
        guarded = compat_aiohttp.connector(limit=0, keepalive_timeout=4.0)
        try:
            assert type(guarded) is compat_aiohttp.GuardedConnector
        finally:
            await guarded.close()

    asyncio.run(check())


def test_an_aiohttp_without_them_gets_a_connection_per_request(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat_aiohttp, "_missing", None)
    monkeypatch.setattr(compat_aiohttp, "missing_internals", lambda loop: ["TCPConnector._get"])

    async def check() -> None:
        conn = compat_aiohttp.connector(limit=0, keepalive_timeout=4.0)
        try:
            assert type(conn) is aiohttp.TCPConnector and conn.force_close
        finally:
            await conn.close()

    with caplog.at_level(logging.WARNING, logger="mlxproxy"):
        asyncio.run(check())
    assert "lacks TCPConnector._get" in caplog.text and "not reused" in caplog.text


def test_the_list_names_what_the_module_uses() -> None:
    source = Path(compat_aiohttp.__file__).read_text(encoding="utf-8")
    for names in compat_aiohttp.PRIVATE_NAMES.values():
        for name in names:
            assert f".{name}" in source or f'"{name}"' in source, name
