"""Make the README screenshot of the live page's conversations panel (run by hand, not a test):

    PYTHONPATH=. python tests/readme_conversations.py docs/img/conversations.png

Three scripted agents (sim/agent.py) through a proxy against a simulated server with a prompt
cache: a well-behaved one, one with a per-request header line at the front of its system
prompt, and one that re-orders its tools at turn 3; the panel is shot when all have finished.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import orjson

from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from mlxproxy.sim.agent import Agent, AgentKnobs
from mlxproxy.sim.app import create_app as create_sim

sys.path.insert(0, str(Path(__file__).parent))
from browser import Chromium
from support import wait_for


def run_agent(url: str, agent: Agent, turns: int) -> None:
    with httpx.Client(timeout=60) as c:
        for t in range(1, turns + 1):
            with c.stream("POST", url + "/v1/chat/completions", json=agent.request(t)) as r:
                raw = b"".join(r.iter_bytes())
            events = [orjson.loads(x[6:]) for x in raw.split(b"\n\n") if x.startswith(b"data: {")]
            agent.answered("".join((e["choices"] or [{}])[0].get("delta", {}).get("content") or "" for e in events))


def main(out: str) -> None:
    with ServerThread(create_sim("healthy", speed=2.0, prompt_cache=True, model_name="qwen3-coder")) as sim:
        app = create_app(build_config(None, upstream_url=sim.url, log_requests=False))
        with ServerThread(app) as px:
            run_agent(px.url, Agent("Fix the flaky test.", model="qwen3-coder"), 4)
            run_agent(
                px.url, Agent("Add a --dry-run flag.", model="qwen3-coder", knobs=AgentKnobs(reorder_tools_at=3)), 4
            )
            run_agent(px.url, Agent("Port the parser.", model="qwen3-coder", knobs=AgentKnobs(volatile_header=True)), 4)
            assert wait_for(lambda: len(app.recent.records) == 12)
            with Chromium() as browser:
                page = browser.page()
                page.goto(px.url + "/")
                page.wait_for("document.querySelectorAll('#conversations tr.turn').length === 12")
                page.send(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": 1400, "height": 2000, "deviceScaleFactor": 1, "mobile": False},
                )
                box = page.eval(
                    "(() => { const r = document.querySelector('#conversations').getBoundingClientRect();"
                    " return [r.x, r.y + window.scrollY, r.width, r.height]; })()"
                )
                clip = {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1}
                data = page.send("Page.captureScreenshot", {"format": "png", "clip": clip})["data"]
                Path(out).write_bytes(base64.b64decode(data))
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
