"""Record the rigged cases' raw bytes from a live seed server into tests/fixtures/live/<server>/.

    PYTHONPATH=. .venv/bin/python -m tests.integration.record_live SERVER [SERVER ...]

SERVER is a name of :data:`live_servers.SPECS` (or ``mlx-lm`` for mlx_lm.server from this
interpreter). Each case writes ``<case>.headers`` (status line and response headers as
received) and ``<case>.sse`` or ``<case>.json`` (the body, HTTP framing removed), plus
``<case>.request.json`` (what was sent). ``cases.json`` sums up each case (status, bytes,
finish_reason, usage) and the disconnect case's timings. Only loopback is contacted.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from .live_servers import LiveServer, live_server
from .rigged import build_rigged_model
from .tinymodel import mlx_lm_server

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests/fixtures/live"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]
USAGE = {"stream_options": {"include_usage": True}}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def cases(words_n: int) -> list[tuple[str, dict[str, Any]]]:
    long_prompt = " ".join(f"word{i}" for i in range(6000))
    return [
        (
            "tool_stream",
            {"messages": user("Save my fruit list."), "tools": TOOLS, "max_tokens": 64, "stream": True, **USAGE},
        ),
        ("tool_nonstream", {"messages": user("Save my fruit list."), "tools": TOOLS, "max_tokens": 64}),
        (
            "tool_cut_stream",
            {"messages": user("Save my fruit list."), "tools": TOOLS, "max_tokens": 8, "stream": True, **USAGE},
        ),
        ("tool_cut_nonstream", {"messages": user("Save my fruit list."), "tools": TOOLS, "max_tokens": 8}),
        # the natural stop: words_n words then EOS, max_tokens exactly words_n + 1 (EOS counted) and words_n
        (
            "stop_at_max_stream",
            {"messages": user("Say the words."), "max_tokens": words_n + 1, "stream": True, **USAGE},
        ),
        ("stop_at_max_nonstream", {"messages": user("Say the words."), "max_tokens": words_n + 1}),
        ("stop_at_words_stream", {"messages": user("Say the words."), "max_tokens": words_n, "stream": True, **USAGE}),
        (
            "reasoning_stream",
            {"messages": user("Please think: is it sunny?"), "max_tokens": 64, "stream": True, **USAGE},
        ),
        ("reasoning_nonstream", {"messages": user("Please think: is it sunny?"), "max_tokens": 64}),
        ("context_refusal_stream", {"messages": user(long_prompt), "max_tokens": 16, "stream": True, **USAGE}),
        ("context_refusal_nonstream", {"messages": user(long_prompt), "max_tokens": 16}),
    ]


def _headers(resp: httpx.Response) -> str:
    lines = [f"HTTP/{resp.http_version.split('/')[-1]} {resp.status_code} {resp.reason_phrase}"]
    lines += [f"{k.decode()}: {v.decode()}" for k, v in resp.headers.raw]
    return "\n".join(lines) + "\n"


def _summary(body: bytes, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": len(body)}
    try:
        if not stream:
            obj = json.loads(body)
            ch = (obj.get("choices") or [{}])[0]
            out.update(
                finish_reason=ch.get("finish_reason"),
                usage=obj.get("usage"),
                tool_calls=bool((ch.get("message") or {}).get("tool_calls")),
            )
            return out
        events = [ln[6:] for ln in body.decode(errors="replace").splitlines() if ln.startswith("data: ")]
        out["events"] = len(events)
        for e in events:
            if e.strip() == "[DONE]":
                out["done"] = True
                continue
            obj = json.loads(e)
            for ch in obj.get("choices") or []:
                if ch.get("finish_reason"):
                    out["finish_reason"] = ch["finish_reason"]
                if (ch.get("delta") or {}).get("tool_calls"):
                    out["tool_call_events"] = out.get("tool_call_events", 0) + 1
            if obj.get("usage"):
                out["usage"] = obj["usage"]
    except (ValueError, AttributeError) as exc:
        out["unparsed"] = f"{type(exc).__name__}: {exc}"
    return out


def record(base: str, model: str, outdir: Path, words_n: int) -> dict[str, Any]:
    outdir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    with httpx.Client(trust_env=False, timeout=120.0) as http:
        for name, body in cases(words_n):
            body = {"model": model, **body}
            stream = bool(body.get("stream"))
            with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
                raw = resp.read()
            ext = "sse" if stream and resp.headers.get("content-type", "").startswith("text/event-stream") else "json"
            (outdir / f"{name}.headers").write_text(_headers(resp))
            (outdir / f"{name}.{ext}").write_bytes(raw)
            req = dict(body)
            if name.startswith("context_refusal"):
                req["messages"] = [{"role": "user", "content": "word0 word1 ... word5999 (6000 words)"}]
            (outdir / f"{name}.request.json").write_text(json.dumps(req, indent=1) + "\n")
            summary[name] = {"status": resp.status_code, **_summary(raw, ext == "sse")}
            print(name, summary[name], flush=True)
        summary["disconnect"] = disconnect(http, base, model, outdir)
        print("disconnect", summary["disconnect"], flush=True)
    (outdir / "cases.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def disconnect(http: httpx.Client, base: str, model: str, outdir: Path) -> dict[str, Any]:
    """Read 5 events of a long stream, close it, then time a short request's first content byte
    (``disconnect_next.sse``: its body as lines, for what a server does right after a disconnect)."""
    body = {"model": model, "messages": user("Count forever."), "max_tokens": 2000, "stream": True, **USAGE}
    t0 = time.monotonic()
    got = b""
    with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        status = resp.status_code
        (outdir / "disconnect_stream.headers").write_text(_headers(resp))
        for chunk in resp.iter_raw():
            got += chunk
            if got.count(b"\n\ndata: ") >= 5:
                break
    t_closed = time.monotonic() - t0
    (outdir / "disconnect_stream.sse").write_bytes(got)
    (outdir / "disconnect_stream.request.json").write_text(json.dumps(body, indent=1) + "\n")
    nxt = {"model": model, "messages": user("Say the words."), "max_tokens": 4, "stream": True}
    t1 = time.monotonic()
    ttfb = None
    lines = []
    with http.stream("POST", base + "/v1/chat/completions", json=nxt) as resp:
        next_status = resp.status_code
        for line in resp.iter_lines():
            lines.append(line)
            if ttfb is None and _has_text(line):
                ttfb = time.monotonic() - t1
    (outdir / "disconnect_next.sse").write_text("\n".join(lines) + "\n")
    (outdir / "disconnect_next.request.json").write_text(json.dumps(nxt, indent=1) + "\n")
    return {
        "status": status,
        "next_status": next_status,
        "bytes_read_before_close": len(got),
        "closed_after_s": round(t_closed, 3),
        "next_request_first_content_s": None if ttfb is None else round(ttfb, 3),
        "next_request_total_s": round(time.monotonic() - t1, 3),
    }


def _has_text(line: str) -> bool:
    """An SSE data line whose delta carries text (content or reasoning, as each server names it)."""
    if not line.startswith("data: {"):
        return False
    try:
        obj = json.loads(line[6:])
    except ValueError:
        return False
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
    return False


@contextlib.contextmanager
def _server(name: str, model_dir: Path) -> Iterator[tuple[str, str]]:
    if name == "mlx-lm":
        with mlx_lm_server(model_dir) as url:
            yield url, "default_model"
        return
    with live_server(name, model_dir) as srv:
        s: LiveServer = srv
        yield s.url, s.model


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="mlxproxy-rig-") as tmp:
        rig = build_rigged_model(Path(tmp) / "rigged")
        for name in argv:
            with _server(name, rig.path) as (url, model):
                record(url, model, OUT / name, rig.words_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
