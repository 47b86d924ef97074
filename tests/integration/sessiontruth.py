"""Each recorded session's truth (``truth.json``), from the server and the request bytes, not from
what mlxproxy says.

Per HTTP exchange of a session folder written by :mod:`.record_sessions`:

* ``server``: mlx_lm.server's own ``prompt_tokens`` / ``cached_tokens`` (from the response's
  usage) beside the exact common token prefix with the earlier prompts, each rendered as
  mlx_lm.server renders it (its ``process_message_content`` and the model's chat template with
  the tools) and tokenized with the model's tokenizer; or vllm-mlx's log lines about its prompt
  cache (``System KV cache HIT/MISS``, tokens reused) while the request ran;
* ``diff``: how the request's body differs from the previous main request's (which top-level
  keys changed, the first message index that differs, messages added), so what a client changes
  turn to turn is seen from the bytes;
* ``timing``: the tap's TTFT (first token-bearing byte) and the proxy's own;
* ``mlxproxy_today``: the proxy's record fields about conversations and the cache doctor.

The expected grouping and cause per exchange come from ``expected.json`` in the folder when
present (written by hand after reading ``diff``; see FINDINGS.md), else are left out.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from .sessiontap import _chunked_end


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """(head, body) of a raw HTTP response, the chunked framing removed."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
        out = bytearray()
        i = 0
        while i < len(body):
            eol = body.find(b"\r\n", i)
            if eol < 0:
                break
            size = int(body[i:eol].split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            out += body[eol + 2 : eol + 2 + size]
            i = eol + 2 + size + 2
        body = bytes(out)
    return head, body


def events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (``data:`` lines), or the one JSON document."""
    out: list[Any] = []
    text = body.decode("utf-8", "replace")
    if "data:" not in text[:200] and "event:" not in text[:200]:
        try:
            return [json.loads(text)]
        except ValueError:
            return []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            if payload and payload != "[DONE]":
                try:
                    out.append(json.loads(payload))
                except ValueError:
                    pass
    return out


def usage_in(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict):
        u = obj.get("usage")
        if isinstance(u, dict) and u:
            return u
        for v in obj.values():
            if isinstance(v, dict):
                found = usage_in(v)
                if found:
                    return found
    return None


def usage_of(raw_response: bytes) -> dict[str, Any] | None:
    _, body = dechunk(raw_response)
    last = None
    for ev in events(body):
        u = usage_in(ev)
        if u:
            last = u
    return last


def cached_of(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        d = usage.get(key)
        if isinstance(d, dict) and isinstance(d.get("cached_tokens"), int):
            return int(d["cached_tokens"])
    v = usage.get("cache_read_input_tokens")
    return int(v) if isinstance(v, int) else None


def prompt_of(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    for key in ("prompt_tokens", "input_tokens"):
        if isinstance(usage.get(key), int):
            return int(usage[key])
    return None


class Renderer:
    """Chat requests rendered and tokenized as mlx_lm.server does (its own functions)."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.server import process_message_content
        from mlx_lm.utils import load_tokenizer

        self.tok = load_tokenizer(Path(model_dir))
        self._process = process_message_content

    def tokens(self, body: dict[str, Any]) -> list[int]:
        messages = copy.deepcopy(body.get("messages") or [])
        self._process(messages)
        tools = body.get("tools") or None
        out = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(out)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return None


def _first_diff(old: list[Any], new: list[Any]) -> int | None:
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return i
    return None if len(old) <= len(new) else len(new)


def body_diff(old: Any, new: Any) -> dict[str, Any]:
    """How ``new`` differs from ``old`` (request bodies): keys changed, messages' first difference."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return {}
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    out: dict[str, Any] = {"keys_changed": keys}
    for field in ("messages", "input", "system", "tools"):
        a, b = old.get(field), new.get(field)
        if isinstance(a, list) and isinstance(b, list) and a != b:
            i = _first_diff(a, b)
            out[field] = {"old_len": len(a), "new_len": len(b), "first_diff": i}
            if i is not None and i < len(a) and i < len(b):
                out[field]["old_at_diff"] = _clip(a[i])
                out[field]["new_at_diff"] = _clip(b[i])
    return out


def _clip(v: Any, n: int = 300) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= n else s[: n // 2] + " ... " + s[-n // 2 :]


_VLLM_CACHE = re.compile(r"(?i)(kv cache|prefix cache|cache (hit|miss)|tokens reused|cached)")


def write_truth(folder: Path, model_dir: Path | None = None) -> dict[str, Any]:
    session = json.loads((folder / "session.json").read_text())
    records = {}
    for line in (folder / "records.jsonl").read_text().splitlines():
        d = json.loads(line)
        records[d.get("id")] = d
    log_lines = []
    if (folder / "server.log").exists():
        for line in (folder / "server.log").read_text().splitlines():
            t, _, text = line.partition("\t")
            try:
                log_lines.append((float(t), text))
            except ValueError:
                pass
    renderer = Renderer(model_dir) if model_dir is not None and session["server"] == "mlx-lm" else None
    if (folder / "expected.json").exists():  # written by hand where the derivation is not enough
        want = {int(k): v for k, v in json.loads((folder / "expected.json").read_text()).items()}
    else:
        want = expected(folder)
    calibration = {}
    if (folder / "calibration.json").exists():
        calibration = json.loads((folder / "calibration.json").read_text())
    prior_tokens: list[list[int]] = []
    prev_body: dict[str, Any] | None = None
    out = []
    for ex in session["exchanges"]:
        n = ex["n"]
        timing = json.loads((folder / f"turn{n}.timing.json").read_text())
        body = _json((folder / f"turn{n}.request.json").read_bytes())
        response = (folder / f"turn{n}.response").read_bytes()
        status = response.split(b"\r\n", 1)[0].decode("latin-1")
        usage = usage_of(response)
        entry: dict[str, Any] = {
            "n": n,
            "request": f"{ex['method']} {ex['path']}",
            "cli_turn": ex["cli_turn"],
            "status": status,
            "ttft_s": timing["t_first_token"],
            "t_sent_session": timing["t_sent_session"],
        }
        rec = records.get(ex["request_id"])
        up_path = folder / f"turn{n}.upstream.response"
        if up_path.exists():  # the server's own bytes, before the proxy
            usage = usage_of(up_path.read_bytes())
            source = "the server's response (tap between proxy and server)"
        else:
            source = "the response to the client"
        server: dict[str, Any] = {"prompt_tokens": prompt_of(usage), "cached_tokens": cached_of(usage)}
        server["usage_source"] = source if usage else None
        if not usage and rec is not None and rec.get("usage_injected"):
            # the proxy asked the server for usage (the client did not) and kept it off the
            # client's stream: the server's numbers are in the proxy's record, as the server sent them
            server.update(
                prompt_tokens=rec.get("prompt_tokens"),
                cached_tokens=rec.get("cached_tokens"),
                usage_source="server usage the proxy injected and recorded",
            )
        if renderer is not None and isinstance(body, dict) and "messages" in body:
            toks = renderer.tokens(body)
            best = max((common_prefix(p, toks) for p in prior_tokens), default=0)
            server["rendered_prompt_tokens"] = len(toks)
            server["common_prefix_tokens"] = best
            prior_tokens.append(toks)
        if log_lines:
            t0 = timing["t_sent_session"]
            t1 = t0 + (timing["t_end"] or 0.0) + 0.3
            server["log"] = [text for t, text in log_lines if t0 - 0.05 <= t <= t1 and _VLLM_CACHE.search(text)]
        entry["server"] = server
        if isinstance(body, dict) and ("messages" in body or "input" in body):
            entry["diff_from_previous"] = body_diff(prev_body, body) if prev_body is not None else None
            entry["body_keys"] = sorted(body)
            entry["n_messages"] = len(body.get("messages") or body.get("input") or [])
            prev_body = body
        if str(n) in calibration:
            entry["calibration"] = calibration[str(n)]
        if rec is not None:
            entry["mlxproxy_today"] = {
                k: rec.get(k)
                for k in (
                    "conversation_id",
                    "turn",
                    "prompt_tokens",
                    "cached_tokens",
                    "ttft_s",
                    "prefix_reusable_tokens",
                    "prefix_diverged_at",
                    "reprefill_cause",
                    "reprefill_at",
                    "reprefill_lost_s",
                    "anomalies",
                    "anomaly_evidence",
                )
            }
        if n in want:
            entry["expected"] = want[n]
        cal = calibration.get(str(n))
        if cal and cal["warm"]["ttft_s"] is not None and timing["t_first_token"] is not None:
            # what this turn's TTFT lost against a full hit of the same prompt, measured
            entry["measured_lost_s"] = round(max(0.0, timing["t_first_token"] - cal["warm"]["ttft_s"]), 6)
            if cal["cold"]["ttft_s"] is not None:
                entry["cold_minus_warm_s"] = round(cal["cold"]["ttft_s"] - cal["warm"]["ttft_s"], 6)
        out.append(entry)
    truth = {
        "client": session["client"],
        "client_version": session["client_version"],
        "server": session["server"],
        "server_version": session["server_version"],
        "exchanges": out,
    }
    (folder / "truth.json").write_text(json.dumps(truth, indent=2, ensure_ascii=False) + "\n")
    return truth


if __name__ == "__main__":
    import sys

    write_truth(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)


# --- the expected verdicts, from the request bytes ------------------------------------------

GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


def _text(v: Any) -> str:
    """A content value as the server's prompt shows it: a string, or the texts of a block list
    (markers such as ``cache_control`` do not reach the prompt)."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "".join(_text(p) for p in v)
    if isinstance(v, dict):
        if isinstance(v.get("text"), str):
            return v["text"]
        if "content" in v:
            return _text(v["content"])
        return json.dumps({k: x for k, x in v.items() if k not in ("cache_control", "id")}, sort_keys=True)
    return str(v)


def rendered(body: dict[str, Any]) -> dict[str, Any]:
    """The prompt's parts in the server's order (system, tools, messages), each as text."""
    system = []
    msgs = []
    if isinstance(body.get("instructions"), str):
        system.append(body["instructions"])
    if body.get("system") is not None:
        system.append(_text(body["system"]))
    items = body.get("messages") if isinstance(body.get("messages"), list) else body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    index = []  # each rendered message's index in the body's list
    for k, m in enumerate(items or []):
        if not isinstance(m, dict):
            continue
        role = m.get("role") or m.get("type") or ""
        if role in ("system", "developer") and not msgs:
            system.append(_text(m.get("content")))
            continue
        extra = ""
        if m.get("tool_calls"):
            extra = json.dumps([c.get("function", c) for c in m["tool_calls"]], sort_keys=True)
        if m.get("type") in ("function_call", "function_call_output"):
            extra = json.dumps({k: m.get(k) for k in ("name", "arguments", "output")}, sort_keys=True)
        msgs.append(f"{role}\n{_text(m.get('content'))}{extra}")
        index.append(k)
    tools = [json.dumps(t, sort_keys=True) for t in body.get("tools") or []]
    field = "messages" if isinstance(body.get("messages"), list) else "input"
    return {
        "system": "\n".join(system),
        "tools": tools,
        "messages": msgs,
        "index": index,
        "field": field,
        "model": body.get("model"),
    }


def _line_diff(old: str, new: str) -> tuple[int, int]:
    """(first differing line index, lines changed in place) between two texts."""
    a, b = old.split("\n"), new.split("\n")
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    changed = sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))
    return i, changed


def prompt_cause(old: dict[str, Any], new: dict[str, Any]) -> tuple[str | None, str | None]:
    """Why ``new`` (rendered) does not extend ``old``: (cause, where), or (None, None)."""
    if old["model"] != new["model"]:
        return "model_changed", "model"
    if old["system"] != new["system"]:
        line, changed = _line_diff(old["system"], new["system"])
        if changed <= 2 and len(old["system"].split("\n")) >= 4:
            return "volatile_span", f"system line {line + 1}"
        return "system_changed", f"system line {line + 1}"
    if old["tools"] != new["tools"]:
        return "tools_changed", "tools"
    a, b = old["messages"], new["messages"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            # the previous last message re-sent with more text appended keeps its prefix
            if i == len(a) - 1 and y.startswith(x):
                return None, None
            return "history_rewritten", f"{new['field']}[{new['index'][i]}]"
    if len(b) < len(a):
        return "history_rewritten", f"{new['field']}[{new['index'][len(b)] if len(b) < len(new['index']) else len(b)}]"
    return None, None


def _key(body: dict[str, Any]) -> str:
    return rendered(body)["system"][:200]


def expected(folder: Path) -> dict[int, dict[str, Any]]:
    """Per exchange: side request or turn, conversation and turn number, and the expected cause
    with its place, derived from the request bytes alone (see FINDINGS.md for each client)."""
    session = json.loads((folder / "session.json").read_text())
    bodies: dict[int, dict[str, Any]] = {}
    for ex in session["exchanges"]:
        if ex["method"] == "POST" and ex["path"].split("?", 1)[0] in GENERATION_PATHS:
            b = _json((folder / f"turn{ex['n']}.request.json").read_bytes())
            if isinstance(b, dict):
                bodies[ex["n"]] = b
    # the main conversation: the system prompt of the generation request offering the most tools
    # (ties: the most frequent); any other system prompt is a side request (a title, a memory
    # extraction, a quota check)
    counts: dict[str, int] = {}
    for b in bodies.values():
        counts[_key(b)] = counts.get(_key(b), 0) + 1
    main_key = (
        max(bodies.values(), key=lambda b: (len(b.get("tools") or []), counts[_key(b)]), default=None)
        if bodies
        else None
    )
    main = _key(main_key) if main_key is not None else None
    out: dict[int, dict[str, Any]] = {}
    prev: dict[str, Any] | None = None
    turn = 0
    for ex in session["exchanges"]:
        n = ex["n"]
        b = bodies.get(n)
        if b is None or _key(b) != main:
            kind = "probe" if ex["method"] in ("HEAD", "GET") else "count_tokens" if "count_tokens" in ex["path"] else None
            if kind is None and b is not None:
                sys_ = rendered(b)["system"].lower()
                kind = "title" if "title" in sys_[:300] else "memory" if "memory" in sys_[:300] else "side"
            out[n] = {"role": "side", "kind": kind or "other", "conversation": None, "turn": None}
            continue
        r = rendered(b)
        turn += 1
        cause, at = prompt_cause(prev, r) if prev is not None else (None, None)
        out[n] = {"role": "turn", "conversation": "A", "turn": turn, "cause": cause, "at": at}
        prev = r
    return out
