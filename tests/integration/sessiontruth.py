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
    expected = {}
    if (folder / "expected.json").exists():
        expected = {int(k): v for k, v in json.loads((folder / "expected.json").read_text()).items()}
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
        if n in expected:
            entry["expected"] = expected[n]
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
