"""Make the README screenshot of the live page (run by hand, not a test):

    PYTHONPATH=. python tests/readme_screenshot.py docs/img/live-page.png [SECONDS]

Six simulated servers behind a proxy under steady load; after SECONDS (default 40) the page is
shot with the timeline of a stalling mlx-vlm request open.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from mlxproxy.sim.app import create_app as create_sim

sys.path.insert(0, str(Path(__file__).parent))
from browser import Chromium

PROFILES = {
    "mlx-openai-server": {},
    "mlx-omni-server": {},
    "mlx-vlm": {"stall_every_tokens": 40, "stall_s": 1.5},
    "phantom-usage": {},
    "omlx": {},
    "mlx-lm": {},
}
stop = threading.Event()


def chat(url, model, max_tokens, prompt=None):
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Refactor this function"}],
    }
    h = {"content-type": "application/json"}
    if prompt:
        h["x-sim-prompt-tokens"] = str(prompt)
    with httpx.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body), headers=h, timeout=120) as r:
        for _ in r.iter_bytes():
            pass


def loop(url, model, max_tokens, pause, prompt=None):
    while not stop.is_set():
        try:
            chat(url, model, max_tokens, prompt)
        except Exception as e:
            print(model, e)
        stop.wait(pause)


with contextlib.ExitStack() as es:
    sims = {n: es.enter_context(ServerThread(create_sim(n, **k))) for n, k in PROFILES.items()}
    app = create_app(
        build_config(
            {"upstreams": [{"name": n, "url": s.url, "models": [n]} for n, s in sims.items()]}, log_requests=False
        )
    )
    px = es.enter_context(ServerThread(app))
    url = px.url
    jobs = [
        ("mlx-openai-server", 180, 0.5),
        ("mlx-openai-server", 180, 0.9),
        ("mlx-omni-server", 120, 0.3),
        ("mlx-omni-server", 120, 0.6),
        ("mlx-vlm", 160, 1.0),
        ("phantom-usage", 90, 3.0),
        ("mlx-lm", 140, 1.0, 6000),
        ("omlx", 60, 6.0, 40000),
        ("omlx", 100, 2.0),
    ]
    ts = [threading.Thread(target=loop, args=(url, *j), daemon=True) for j in jobs]
    for t in ts:
        t.start()
        time.sleep(0.3)
    with Chromium() as c:
        p = c.page()
        p.goto(url + "/")
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 40)
        rec = max((r for r in app.recent.records if r.model == "mlx-vlm" and r.stall_count), key=lambda r: r.started_at)
        p.click(f'#recent tr[data-id="{rec.id}"]')
        time.sleep(0.6)
        p.eval("window.scrollTo(0, 0); document.querySelector('#recent').scrollTop = 0")
        p.screenshot(sys.argv[1])
        print("errors", p.errors)
    stop.set()
