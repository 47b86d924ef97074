"""The live page at the proxy's root, in a real headless Chromium (tests/browser.py), with
simulated servers behind the proxy: live streams update, a finished request's timeline opens,
the charts and swim lanes have data, an anomalous profile shows its anomalies with evidence,
nothing is logged as an error, and the proxy key is enforced. Screenshots go to the test's
tmp dir (or $MLXPROXY_TEST_ARTIFACTS) and their paths are printed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from browser import Chromium, Page, require_chromium
from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.sim.app import create_app as create_sim
from support import wait_for

KEY = "pk-web-test-3b9d2f"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    require_chromium()
    with Chromium() as c:
        yield c


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    d = Path(os.environ.get("MLXPROXY_TEST_ARTIFACTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def stack(**cfg) -> Iterator[tuple[str, ProxyApp]]:
    with contextlib.ExitStack() as es:
        sims = {
            "healthy": es.enter_context(ServerThread(create_sim("healthy", decode_tps=40.0))),
            "mlx-lm": es.enter_context(ServerThread(create_sim("mlx-lm", speed=4.0))),
            "phantom-usage": es.enter_context(ServerThread(create_sim("phantom-usage", speed=4.0))),
        }
        raw = {"upstreams": [{"name": n, "url": s.url, "models": [n]} for n, s in sims.items()], **cfg}
        app = create_app(build_config(raw, log_requests=False))
        px = es.enter_context(ServerThread(app, server_header=False, date_header=False))
        yield px.url, app


def chat(url: str, model: str, max_tokens: int, headers: dict[str, str] | None = None) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        content=orjson.dumps(body),
        timeout=60,
        headers={"content-type": "application/json", **(headers or {})},
    ) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            pass


def in_background(*calls) -> list[threading.Thread]:
    threads = [threading.Thread(target=c[0], args=c[1:], daemon=True) for c in calls]
    for t in threads:
        t.start()
    return threads


def assert_no_errors(page: Page) -> None:
    assert page.errors == [], page.errors


@contextlib.contextmanager
def served(tmp_path: Path, key_env: str | None = None) -> Iterator[str]:
    """`mlxproxy serve` (a real process) in front of three simulated servers; yields its URL."""
    from support import start

    with contextlib.ExitStack() as es:
        sims = {
            "healthy": es.enter_context(ServerThread(create_sim("healthy", decode_tps=40.0))),
            "mlx-lm": es.enter_context(ServerThread(create_sim("mlx-lm", speed=4.0))),
            "phantom-usage": es.enter_context(ServerThread(create_sim("phantom-usage", speed=4.0))),
        }
        cfg: dict = {
            "port": 0,
            "log_requests": False,
            "upstreams": [{"name": n, "url": s.url, "models": [n]} for n, s in sims.items()],
        }
        if key_env:
            cfg["proxy_api_key_env"] = key_env
        config = tmp_path / "proxy.yaml"
        config.write_text(yaml.safe_dump(cfg))
        proxy = start(["serve", "--config", str(config), "--log-level", "warning"], "listening on")
        es.callback(proxy.stop)
        yield proxy.url
        assert not [line for line in proxy.lines if "Traceback" in line or "ERROR" in line], "".join(proxy.lines[-30:])


def streams(url: str, headers: dict[str, str] | None = None, **params) -> dict:
    """What the proxy itself says (`/streams`), to check the page against."""
    r = httpx.get(url + "/streams", params=params, headers=headers)
    assert r.status_code == 200
    return r.json()


def finished(url: str, n: int, headers: dict[str, str] | None = None) -> bool:
    return wait_for(lambda: streams(url, headers)["seq"] == n, 10)


def test_live_page_shows_streams_timelines_charts_and_anomalies(
    chromium: Chromium, artifacts: Path, tmp_path: Path
) -> None:
    with served(tmp_path) as url:
        for model in ("mlx-lm", "phantom-usage", "mlx-lm", "phantom-usage"):
            chat(url, model, 60)
        assert finished(url, 4)
        page = chromium.page()
        page.goto(url + "/")
        # finished requests are listed, newest first, with their figures
        page.wait_for("document.querySelectorAll('#recent tbody tr').length === 4")
        # two long streams (40 tok/s, 320 tokens: 8 s) are in flight while the page reads them twice
        threads = in_background((chat, url, "healthy", 320), (chat, url, "healthy", 320))
        page.wait_for("document.querySelectorAll('#inflight tbody tr').length === 2")
        first = page.eval(
            "Object.fromEntries([...document.querySelectorAll('#inflight tbody tr')]"
            ".map(tr => [tr.dataset.id, +tr.querySelector('td.tokens').textContent]))"
        )
        assert set(first) == {s["id"] for s in streams(url)["in_flight"]}  # exactly the proxy's streams in flight
        rid = min(first, key=first.get)
        later = page.wait_for(
            f"(() => {{ const tr = document.querySelector('#inflight tr[data-id=\"{rid}\"]');"
            f" const n = tr ? +tr.querySelector('td.tokens').textContent : 0;"
            f" return n > {first[rid]} ? n : 0; }})()"
        )
        assert later > first[rid]
        # ... and a live bar in the swim lanes of its upstream
        assert page.eval("document.querySelectorAll('#lanes g.span.live').length") == 2
        lanes = page.eval("[...document.querySelectorAll('#lanes text.lane-label')].map(t => t.textContent)")
        assert any(t.startswith("healthy") for t in lanes) and any(t.startswith("phantom-usage") for t in lanes)
        shot = page.screenshot(artifacts / "live-page-streaming.png")
        print(f"\nscreenshot: {shot}")
        for t in threads:
            t.join(30)
        assert finished(url, 6)
        page.wait_for(
            "document.querySelectorAll('#recent tbody tr').length === 6"
            " && document.querySelectorAll('#inflight tbody tr').length === 0"
        )
        records = streams(url, timeline=1)["recent"]

        # the charts have one point per finished request (all six are ok)
        assert page.eval("document.querySelectorAll('#chart-ttft circle').length") == 6
        assert page.eval("document.querySelectorAll('#chart-decode circle').length") == 6
        assert page.eval("document.querySelectorAll('#chart-aggregate polyline').length") == 3  # one per model
        # ... every point inside the plot: the current 10 s bucket is drawn by now, not past it
        xs = page.eval(
            "[...document.querySelectorAll('#chart-aggregate polyline')]"
            ".flatMap(p => p.getAttribute('points').split(' ').map(q => +q.split(',')[0]))"
        )
        right = page.eval(
            "(() => { const r = document.querySelector('#chart-aggregate rect.box');"
            " return +r.getAttribute('x') + +r.getAttribute('width'); })()"
        )
        assert xs and max(xs) <= right + 0.5, (xs, right)
        # ... and each model is seen: a line, or a dot where it has one bucket so far (a polyline of
        # one point draws nothing)
        seen = page.eval(
            "[...document.querySelectorAll('#chart-aggregate polyline')]"
            ".filter(p => p.getAttribute('points').split(' ').length > 1).length"
            " + document.querySelectorAll('#chart-aggregate circle.series-dot').length"
        )
        assert seen == 3, seen
        assert page.eval("document.querySelectorAll('#lanes g.span').length") == 6

        # a click on a finished request opens its timeline: one mark per token event, TTFT marked
        rec = next(r for r in records if r["model"] == "healthy")
        page.click(f'#recent tr[data-id="{rec["id"]}"]')
        page.wait_for("!document.querySelector('#detail').hidden")
        assert page.eval("document.querySelector('#detail-id').textContent").startswith(rec["id"])
        assert (
            page.eval("document.querySelectorAll('#detail-plot .tok line').length")
            == len(rec["event_offsets_ms"])
            > 200
        )
        assert page.eval("!!document.querySelector('#detail-plot line.ttft')")
        figures = page.eval(
            "Object.fromEntries([...document.querySelectorAll('#detail-figures dt')]"
            ".map(dt => [dt.textContent, dt.nextElementSibling.textContent]))"
        )
        assert figures["TTFT"] == f"{rec['ttft_s']:.3f} s" and figures["tokens counted"] == str(
            rec["completion_tokens_counted"]
        )

        # the anomalous profile: its anomalies are listed with the detector's evidence
        bad = [r for r in records if r["model"] == "phantom-usage"]
        assert len(bad) == 2 and all(r["anomalies"] for r in bad)
        shown = page.eval(
            "[...document.querySelectorAll('#anomalies li')].map(li => [li.dataset.id,"
            " li.querySelector('b').textContent, li.querySelector('.evidence').textContent])"
        )
        expected = sorted([r["id"], k, r["anomaly_evidence"][k]] for r in bad for k in r["anomalies"])
        assert sorted(shown) == expected and all(e for _, _, e in shown)
        page.click(f'#anomalies li[data-id="{bad[0]["id"]}"]')
        page.wait_for(f"document.querySelector('#detail-id').textContent.startsWith('{bad[0]['id']}')")
        detail = page.eval("document.querySelector('#detail-anomalies').textContent")
        for kind in bad[0]["anomalies"]:
            assert kind in detail and bad[0]["anomaly_evidence"][kind] in detail
        # reported vs counted tokens: usage claims 4x what was streamed
        assert page.eval("document.querySelector('#detail-plot line.reported') !== null")

        # sorting by a column orders the rows by it
        page.click('#recent th[data-col="ttft_s"]')
        ttfts = page.eval("[...document.querySelectorAll('#recent tbody tr')].map(tr => +tr.children[4].textContent)")
        assert ttfts == sorted(ttfts) and len(ttfts) == 6
        print(f"screenshot: {page.screenshot(artifacts / 'live-page-timeline.png')}")
        assert_no_errors(page)


def test_live_page_needs_the_proxy_key(chromium: Chromium, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXPROXY_WEB_TEST_KEY", KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    with served(tmp_path, "MLXPROXY_WEB_TEST_KEY") as url:
        chat(url, "mlx-lm", 30, auth)
        assert finished(url, 1, auth)
        assert httpx.get(url + "/").status_code == 200  # the page itself holds no data
        assert httpx.get(url + "/streams").status_code == 401  # its data does
        page = chromium.page()
        page.goto(url + "/")
        page.wait_for("!document.querySelector('#keybox').hidden")
        assert page.eval("document.querySelector('#main').hidden")
        assert page.eval("document.querySelectorAll('#recent tbody tr').length") == 0
        assert page.eval("document.querySelector('#status').textContent") == "needs the proxy key"
        # a wrong key is refused, the right one shows the data
        page.eval(
            "document.querySelector('#keyinput').value = 'wrong'; document.querySelector('#keybox button').click()"
        )
        page.wait_for("document.querySelector('#keyerror').textContent === 'That key was refused.'")
        assert page.eval("document.querySelectorAll('#recent tbody tr').length") == 0
        page.eval(
            f"document.querySelector('#keyinput').value = '{KEY}'; document.querySelector('#keybox button').click()"
        )
        page.wait_for("document.querySelectorAll('#recent tbody tr').length === 1")
        # only 401s from the data endpoint were logged (the browser logs each refused request)
        assert page.errors and all("401" in e for e in page.errors), page.errors

        # a key in the URL fragment (never sent to the server) works too and leaves the address bar
        page2 = chromium.page()
        page2.goto(url + f"/#key={KEY}")
        page2.wait_for("document.querySelectorAll('#recent tbody tr').length === 1")
        assert page2.eval("location.hash") == ""
        assert_no_errors(page2)
        assert all(KEY not in u for u in page2.requests)


def test_page_files_are_packaged_and_open_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """No browser needed: the page, its script and stylesheet come from the package with a
    strict content security policy; nothing on the page loads from another origin."""
    monkeypatch.setenv("MLXPROXY_WEB_TEST_KEY", KEY)
    with stack(proxy_api_key_env="MLXPROXY_WEB_TEST_KEY") as (url, app):
        with httpx.Client(base_url=url) as c:
            page = c.get("/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in page.headers["content-security-policy"]
            for asset, kind in [
                ("/ui/app.js", "text/javascript"),
                ("/ui/app.css", "text/css"),
                ("/ui/LICENSE", "text/plain"),
            ]:
                r = c.get(asset)
                assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.content, asset
                assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "") and "https://" not in r.text
            assert "https://" not in page.text and "http://HOST" in page.text
            assert c.head("/").status_code == 200
            r = c.post("/")
            assert (
                r.status_code == 405
                and r.json()["error"]["code"] == "method_not_allowed"
                and r.headers["allow"] == "GET, HEAD"
            )
            assert c.get("/streams").status_code == 401
            assert app.requests_seen == 0  # none of these was forwarded


def test_streams_since_and_timeline(tmp_path: Path) -> None:
    with stack(capture=str(tmp_path / "cap.jsonl"), capture_responses=True) as (url, app):
        with httpx.Client(base_url=url) as c:
            d = c.get("/streams").json()
            assert d["seq"] == 0 and d["recent"] == [] and d["in_flight"] == []
            assert d["stall_rule"] == {"factor": 10.0, "min_s": 1.0} and d["now"] > 1.7e9
            for _ in range(3):
                chat(url, "mlx-lm", 20)
            assert wait_for(lambda: app.recent.total == 3)  # the record follows the response's last byte
            d = c.get("/streams").json()
            assert d["seq"] == 3 and len(d["recent"]) == 3 and "event_offsets_ms" not in d["recent"][0]
            ids = [r["id"] for r in d["recent"]]  # newest first
            assert ids == [r.id for r in reversed(app.recent.records)]
            d = c.get("/streams", params={"since": 1, "timeline": 1}).json()
            assert [r["id"] for r in d["recent"]] == ids[:2] and d["seq"] == 3
            assert all(len(r["event_offsets_ms"]) == r["generated_events"] > 0 for r in d["recent"])
            text = app.recent.records[-1].response_text  # kept for the capture...
            assert text and len(text) > 20
            body = c.get("/streams", params={"since": 0, "timeline": 1}).text
            assert text not in body and "response_text" not in body and "reasoning_text" not in body  # ...never shown
            one = c.get("/streams", params={"id": ids[1], "timeline": 1}).json()["recent"]
            assert [r["id"] for r in one] == [ids[1]] and len(one[0]["event_offsets_ms"]) == one[0]["generated_events"]
            assert [
                r["id"]
                for r in c.get("/streams", params=[("id", ids[0]), ("id", ids[2]), ("id", "gone")]).json()["recent"]
            ] == [ids[0], ids[2]]
            assert c.get("/streams", params={"since": 3}).json()["recent"] == []
            assert len(c.get("/streams", params={"since": 99}).json()["recent"]) == 3  # a restarted proxy: all
            for bad in ({"since": "-1"}, {"since": "x"}, {"timeline": "yes"}):
                r = c.get("/streams", params=bad)
                err = r.json()["error"]
                assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] is None, bad
                assert list(bad)[0] in err["message"]


def test_an_own_route_that_fails_answers_an_openai_shaped_500(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with stack() as (url, app):
        monkeypatch.setattr(app, "recent", None)  # a bug in the data endpoint
        r = httpx.get(url + "/streams")
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "internal_error" and "/streams" in err["message"]
        assert httpx.get(url + "/healthz").status_code == 200  # the rest keeps working
        assert any("own route /streams failed" in r.getMessage() for r in caplog.records)
        assert not any(r.exc_info for r in caplog.records)  # one line, no traceback


def test_record_to_dict_equals_the_deep_copy_it_replaced() -> None:
    """`Record.to_dict` copies shallowly (asdict deep-copied every timeline float, ~1 ms per
    500-event record, which stalled the event loop on each /streams answer); the result is the same."""
    import dataclasses

    from mlxproxy.core.record import Record

    r = Record(
        id="r1",
        started_at=1.7e9,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        ttft_s=0.1,
        anomalies=("stall",),
        anomaly_evidence={"stall": "3 gaps"},
        tags=("replay",),
        prefill_progress=(5, 10),
        server_claims={"timings": {"tps": 50.0}},
        event_offsets_s=(0.1, 0.2),
        response_text="hello",
    )
    for timeline in (False, True):
        old = dataclasses.asdict(r)
        old.update(anomalies=["stall"], tags=["replay"], prefill_progress=[5, 10])
        old.pop("t_start_mono")
        offs = old.pop("event_offsets_s")
        if timeline:
            old["event_offsets_ms"] = [round(o * 1000.0, 3) for o in offs]
        else:
            old.pop("response_text")
            old.pop("reasoning_text")
        new = r.to_dict(timeline=timeline)
        assert orjson.dumps(new) == orjson.dumps(old) and list(new) == list(old)
        new["server_claims"]["timings"]["tps"] = 0.0
        new["anomaly_evidence"]["stall"] = "changed"
        assert r.server_claims["timings"]["tps"] == 50.0 and r.anomaly_evidence["stall"] == "3 gaps"  # a copy


def test_an_unreachable_upstream_is_warned_about_at_start_and_shown_in_healthz_and_on_the_page(
    chromium: Chromium, artifacts: Path, tmp_path: Path
) -> None:
    """`serve` with one upstream that answers and one with nothing listening: one warning line
    at start for the dead one, `/healthz` says which can be reached (its older keys unchanged),
    the log line names the dead port whole, and the live page shows a banner for it only."""
    from support import closed_port, start

    dead = closed_port()
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        config = tmp_path / "proxy.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "port": 0,
                    "upstreams": [
                        {"name": "alive", "url": sim.url, "models": ["alive"]},
                        {"name": "gone", "url": f"http://127.0.0.1:{dead}", "models": ["gone"]},
                    ],
                }
            )
        )
        proxy = start(["serve", "--config", str(config)], "listening on")
        try:
            assert wait_for(lambda: any("warning: upstream" in ln for ln in proxy.lines), 10), proxy.lines
            warnings = [ln for ln in proxy.lines if "warning: upstream" in ln]
            assert len(warnings) == 1 and f"'gone' at http://127.0.0.1:{dead} is unreachable" in warnings[0]
            health = httpx.get(proxy.url + "/healthz").json()
            assert {"status", "version", "uptime_s", "in_flight", "requests", "tasks", "upstreams"} <= set(health)
            ups = {u["name"]: u for u in health["upstreams"]}
            assert ups["alive"]["reachable"] is True and ups["alive"]["last_error"] is None
            assert ups["gone"]["reachable"] is False and "ConnectionRefusedError" in ups["gone"]["last_error"]
            assert {"name", "url", "in_flight", "last_error_at"} <= set(ups["gone"])

            r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "gone", "messages": []}, timeout=30)
            assert r.status_code == 502
            assert wait_for(lambda: any(" upstream_unreachable " in ln for ln in proxy.lines), 10)
            line = next(ln for ln in proxy.lines if " upstream_unreachable " in ln)
            error = line.split(" error=", 1)[1].strip()
            assert f"127.0.0.1:{dead} " in error and not error.endswith('…"'), error  # the port whole, not cut

            page = chromium.page()
            page.goto(proxy.url + "/")
            page.wait_for("!document.querySelector('#upstream-health').hidden")
            banner = page.eval("document.querySelector('#upstream-health').textContent")
            assert f"upstream gone at http://127.0.0.1:{dead} is unreachable" in banner and "alive" not in banner
            status = page.wait_for("(t => t.startsWith('live') && t)(document.querySelector('#status').textContent)")
            assert status.startswith("live · 1 request kept · "), status  # the one 502, counted in the singular
            print(f"\nscreenshot: {page.screenshot(artifacts / 'live-page-unreachable-upstream.png')}")
            assert_no_errors(page)
        finally:
            proxy.stop()


def test_a_serial_server_is_one_lane_and_a_queued_request_is_not_called_prefill(
    chromium: Chromium, artifacts: Path
) -> None:
    """Three streams to a serial server at once: one lane (a lane is a stream decoding at a
    time), the queued ones shown waiting with how many are ahead, then their time to the first
    token without calling it prefill; mlx_lm.server's prefill bar goes once tokens flow; at
    1400 px the last time label and the recent table's last column are not cut."""
    with contextlib.ExitStack() as es:
        serial = es.enter_context(ServerThread(create_sim("mlx-openai-server@1.6", decode_tps=20.0)))
        lm = es.enter_context(ServerThread(create_sim("mlx-lm", decode_tps=20.0)))
        raw = {"upstreams": [{"name": "serial", "url": serial.url, "models": ["serial"]},
                             {"name": "mlx-lm", "url": lm.url, "models": ["mlx-lm"]}]}  # fmt: skip
        px = es.enter_context(ServerThread(create_app(build_config(raw, log_requests=False))))
        page = chromium.page()
        page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
        )
        page.goto(px.url + "/")
        threads = in_background(*[(chat, px.url, "serial", 30) for _ in range(3)], (chat, px.url, "mlx-lm", 60))
        cells = "[...document.querySelectorAll('#inflight tbody tr')].map(tr => tr.children[4].textContent)"
        waiting = page.wait_for(f"{cells}.filter(t => /^waiting, [12] ahead of it$/.test(t))")
        assert waiting
        queued = page.wait_for(f"{cells}.filter(t => /^after [0-9.]+ s, [12] in flight before it$/.test(t))")
        assert queued  # a queued request's first token: its wait is not called prefill
        lm_cell = page.wait_for(
            "(() => { const tr = [...document.querySelectorAll('#inflight tbody tr')]"
            ".find(tr => tr.children[2].textContent === 'mlx-lm' && +tr.querySelector('td.tokens').textContent > 2);"
            " return tr ? tr.children[4].textContent : ''; })()"
        )
        assert lm_cell.startswith("after ") and "/" not in lm_cell, lm_cell  # no "1/1" bar while decoding
        seen = page.eval(f"{cells}.join(' | ')")
        assert "prefill" not in seen and "done in" not in seen, seen
        for t in threads:
            t.join(60)
        page.wait_for("document.querySelectorAll('#recent tbody tr').length === 4")
        page.wait_for("document.querySelectorAll('#inflight tbody tr').length === 0")
        lanes = page.eval("[...document.querySelectorAll('#lanes text.lane-label')].map(t => t.textContent)")
        assert "serial (1 lane)" in lanes and "mlx-lm (1 lane)" in lanes, lanes
        cut = page.eval(
            "(() => { const s = document.querySelector('#lanes svg').getBoundingClientRect();"
            " return [...document.querySelectorAll('#lanes text.tick')].map(t => t.getBoundingClientRect())"
            ".filter(r => r.right > s.right + 0.5 || r.left < s.left - 0.5).length; })()"
        )
        assert cut == 0
        assert page.eval(
            "(() => { const s = document.querySelector('#recent'); return s.scrollWidth <= s.clientWidth; })()"
        )
        print(f"\nscreenshot: {page.screenshot(artifacts / 'live-page-serial-one-lane.png')}")
        assert_no_errors(page)
