"""Drive the system's headless Chromium over the Chrome DevTools Protocol (no browser download).

`Chromium` starts Debian's `chromium` with a fresh profile and every flag that keeps it off the
network, then talks CDP over a websocket with aiohttp's client (the `test` extra's; a test
module that imports this one is skipped, saying so, where aiohttp is not installed: the default
install without the extra), on an event loop in a background thread so tests stay synchronous. `Page` collects every console
error, uncaught exception and failed load, and every URL the page requested.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the browser tests talk CDP through aiohttp: pip install -e '.[test]'")

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-breakpad",
    "--metrics-recording-only",
    "--mute-audio",
    "--disable-features=Translate,OptimizationHints,MediaRouter,InterestFeedContentSuggestions",
    "--remote-debugging-port=0",
    "--remote-debugging-address=127.0.0.1",
    "--window-size=1400,1000",
)


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.skip("browser test: no `chromium` on PATH (Debian: apt-get install chromium); .ci/run installs it")
    return path


class CDPError(Exception):
    pass


class Chromium:
    """One headless Chromium process; `page()` opens a tab. Use as a context manager."""

    def __init__(self) -> None:
        self.exe = require_chromium()
        self.profile = tempfile.mkdtemp(prefix="mlxproxy-chromium-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cdp", daemon=True)
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}

    def __enter__(self) -> Chromium:
        self.proc = subprocess.Popen(
            [self.exe, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start (exit code {self.proc.returncode})")
            time.sleep(0.05)  # readiness poll
        port, path = port_file.read_text().splitlines()[:2]
        self.thread.start()
        try:
            self._run(self._connect(f"ws://127.0.0.1:{port}{path}"))
        except BaseException:  # __exit__ will not run: stop the browser here, not leave it orphaned
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self, url: str) -> None:
        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(url, max_msg_size=0)
        self.loop.create_task(self._reader())

    async def _reader(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = msg.json()
            if "id" in data:
                fut = self._waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                page = self._pages.get(data.get("sessionId", ""))
                if page is not None:
                    page._event(data["method"], data.get("params", {}))

    async def _send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        assert self.ws is not None
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._waiting[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.send_json(msg)
        data = await fut
        if "error" in data:
            raise CDPError(f"{method}: {data['error']}")
        return data.get("result", {})

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 30.0
    ) -> dict[str, Any]:
        return self._run(self._send(method, params, session), timeout)

    def page(self, offline: bool = False) -> Page:
        """A new tab; `offline` cuts it off from every network (file: URLs still load)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self._pages[session] = page
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        if offline:
            self.send(
                "Network.emulateNetworkConditions",
                {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
                session=session,
            )
        return page

    def close(self) -> None:
        if self.thread.is_alive():

            async def shut() -> None:
                if self.ws is not None:
                    await self.ws.close()
                if self.session is not None:
                    await self.session.close()

            try:
                self._run(shut(), 10)
            except Exception:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab. `errors` holds every console error, uncaught exception and failed load;
    `requests` every URL the page asked for."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session
        self.errors: list[str] = []
        self.requests: list[str] = []
        self._loaded = threading.Event()

    def _event(self, method: str, p: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.errors.append(
                "console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
            )
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.requests.append(p["request"]["url"])
        elif method == "Network.loadingFailed" and not p.get("canceled"):
            self.errors.append(f"load failed: {p.get('errorText')}")
        elif method == "Page.loadEventFired":
            self._loaded.set()

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def goto(self, url: str, timeout: float = 20.0) -> None:
        self._loaded.clear()
        res = self.send("Page.navigate", {"url": url})
        if res.get("errorText"):
            raise CDPError(f"navigating to {url}: {res['errorText']}")
        if not self._loaded.wait(timeout):
            raise CDPError(f"{url} did not finish loading in {timeout} s")

    def eval(self, expression: str) -> Any:
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise CDPError(f"{expression[:80]}: {res['exceptionDetails'].get('exception', {}).get('description')}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Evaluate `expression` until it is truthy (readiness polling); return its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(
            f"timed out after {timeout} s waiting for: {expression} (last value {value!r}); page errors: {self.errors}"
        )

    def click(self, selector: str) -> None:
        """A real mouse click at the centre of the first element matching `selector`."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({selector!r});
            if (!e) return null; e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        if box is None:
            raise AssertionError(f"nothing matches {selector!r}")
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            )

    def screenshot(self, path: str | os.PathLike[str]) -> Path:
        height = self.eval("Math.ceil(document.documentElement.scrollHeight)")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": min(int(height), 4000), "deviceScaleFactor": 1, "mobile": False},
        )
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        self.send("Emulation.clearDeviceMetricsOverride")
        out = Path(path)
        out.write_bytes(base64.b64decode(data))
        return out
