"""What `mlxproxy bench` sends: synthetic prompts of a given token count, built without any
download. Two probe requests calibrate characters per token against the target's own
`usage.prompt_tokens` (a linear fit, so the chat template's fixed tokens are accounted for);
every prompt starts with a nonce so no prompt cache serves a repeat.

`Prompts` is what every request is (typed once from the options); `calibrated` binds it to one
target (its model and calibration) as `TargetPrompts`, which the tests draw their requests from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.core.text import clip
from mlxproxy.load.commands.common import filler_text, unreachable_message
from mlxproxy.load.data.targets import Calibration, TargetResult
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest
from mlxproxy.load.run.runner import send
from mlxproxy.load.run.shapes import Load, Sequential

__all__ = ["Prompts", "TargetPrompts", "bench_request", "calibrate", "calibrated", "chat_body", "discover_model"]


@dataclass(frozen=True)
class Prompts:
    """What every bench request is: its API (`chat`: /v1/chat/completions; `ollama`: Ollama's
    native /api/chat), its model (None: the target's first), its answer length and whether each
    prompt starts with a nonce of its own."""

    api: str = "chat"
    model: str | None = None
    max_tokens: int = 128
    nonce: bool = True


@dataclass(frozen=True)
class TargetPrompts:
    """`Prompts` for one target: its model, and the calibration that turns tokens into text."""

    prompts: Prompts
    model: str
    calibration: Calibration

    def request(self, tokens: int, label: str, source_id: str | None = None) -> PreparedRequest:
        """One request with a prompt of about `tokens` tokens (its own nonce: no cache hit)."""
        prefix = f"[nonce {os.urandom(6).hex()}] " if self.prompts.nonce else ""
        text = prefix + filler_text(max(1, self.calibration.chars_for(tokens) - len(prefix)))
        return bench_request(self.prompts.api, self.model, text, self.prompts.max_tokens, label, source_id)

    def requests(self, n: int, tokens: int, label: str) -> list[PreparedRequest]:
        return [self.request(tokens, label) for _ in range(n)]


def chat_body(model: str, text: str, max_tokens: int, stream: bool = True) -> bytes:
    obj: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        obj["stream_options"] = {"include_usage": True}
    return orjson.dumps(obj)


def bench_request(
    api: str, model: str, text: str, max_tokens: int, label: str, source_id: str | None = None, stream: bool = True
) -> PreparedRequest:
    """One benchmark request through `api`: Chat Completions, or Ollama's native `/api/chat`
    (its limit is `options.num_predict`; it reports usage on every answer, streamed or not)."""
    headers = (("content-type", "application/json"),)
    if api != "ollama":
        body = chat_body(model, text, max_tokens, stream=stream)
        return PreparedRequest("POST", "/v1/chat/completions", body, headers, source_id=source_id, label=label)
    obj = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "options": {"num_predict": max_tokens, "temperature": 0},
    }
    return PreparedRequest("POST", "/api/chat", orjson.dumps(obj), headers, source_id=source_id, label=label)


async def discover_model(client: MeasuringClient) -> str:
    """The first model id of GET /v1/models, else `default_model` (mlx_lm.server's name)."""
    status, body = await client.fetch("GET", "/v1/models")
    try:
        data = orjson.loads(body).get("data") if status == 200 else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
            return str(data[0]["id"])
    except ValueError:
        pass
    return "default_model"


async def calibrate(client: MeasuringClient, model: str, api: str = "chat") -> tuple[Calibration, list[Record]]:
    """Two non-stream probes of different lengths, one after the other; a line through their
    prompt_tokens."""
    texts = [f"[nonce {os.urandom(6).hex()}] " + filler_text(chars) for chars in (400, 4000)]
    probes = [bench_request(api, model, text, 1, "calibration", stream=False) for text in texts]
    r1, r2 = recs = (await send(Sequential(), Load(probes), client)).records
    c1, c2 = (len(text) for text in texts)
    if r1.prompt_tokens is None or r2.prompt_tokens is None or r2.prompt_tokens <= r1.prompt_tokens:
        return Calibration(), recs
    slope = (r2.prompt_tokens - r1.prompt_tokens) / (c2 - c1)
    intercept = r1.prompt_tokens - slope * c1
    return Calibration(
        slope, intercept, f"fitted on the target's usage: {1 / slope:.2f} chars/token + {intercept:.0f} template tokens"
    ), recs


async def calibrated(client: MeasuringClient, res: TargetResult, prompts: Prompts) -> TargetPrompts | None:
    """`prompts` for the target of `res`: its model and calibration, set on `res` too; None (and
    `res.error` set) when the target cannot be benchmarked."""
    try:
        res.model = prompts.model or await discover_model(client)
    except Exception as exc:  # unreachable target: report and move on
        res.error = unreachable_message(res.target.url, exc)
        return None
    res.calibration, probes = await calibrate(client, res.model, prompts.api)
    bad = [r for r in probes if r.outcome not in OK_OUTCOMES]
    if len(bad) == len(probes):
        r = bad[0]
        res.error = (
            f"probe requests failed: {r.outcome}"
            + (f" (HTTP {r.status})" if r.status else "")
            + (f": {clip(r.error, 200)}" if r.error else "")
        )
        return None
    return TargetPrompts(prompts, res.model, res.calibration)
