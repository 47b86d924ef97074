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


def test_the_read_timer_is_kept_lazily_and_armed_and_dropped_as_aiohttp_does() -> None:
    """A read moves the deadline of the one armed timer (no new timer per body chunk); the
    timer is armed, dropped and fired where aiohttp's own would be."""

    async def check() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = compat_aiohttp.GuardedHandler(loop=loop), ResponseHandler(loop)
        for h in (ours, theirs):
            h.set_response_params(read_timeout=1.0)
            h.start_timeout()
        timer = ours._read_timeout_handle
        for k in range(12):  # reads 0.1 s apart: never silent for 1 s
            await asyncio.sleep(0.1)
            for h in (ours, theirs):
                h._reschedule_timeout()  # what aiohttp does on each read of data
            if k < 3:  # well before the first deadline: the same timer, moved
                assert ours._read_timeout_handle is timer
        assert ours.exception() is None and theirs.exception() is None
        assert ours._read_timeout_handle is not None and theirs._read_timeout_handle is not None
        await asyncio.sleep(1.5)  # silent: both time out, with aiohttp's exception
        for h in (ours, theirs):
            assert isinstance(h.exception(), aiohttp.SocketTimeoutError) and h._read_timeout_handle is None
        ours.set_response_params(read_timeout=None)
        ours.start_timeout()
        assert ours._read_timeout_handle is None

    asyncio.run(check())
