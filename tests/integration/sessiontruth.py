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

from .sessiontap import body_pieces


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """(head, body) of a raw HTTP response, the chunked framing removed."""
    return raw.partition(b"\r\n\r\n")[0], b"".join(piece for piece, _ in body_pieces(raw))


def events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (``data:`` lines), or the one JSON document."""
    out: list[Any] = []
    text = body.decode("utf-8", "replace")
    if text.lstrip().startswith(("{", "[")):
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
    renderer = Renderer(model_dir) if model_dir is not None and session["server"].startswith("mlx-lm") else None
    if (folder / "expected.json").exists():  # written by hand where the derivation is not enough
        want = {int(k): v for k, v in json.loads((folder / "expected.json").read_text()).items()}
    else:
        want = expected(folder)
    calibration = {}
    if (folder / "calibration.json").exists():
        calibration = json.loads((folder / "calibration.json").read_text())
    # the turns again on a server that keeps the conversation (`record_sessions --conversation-cache`)
    conversation_cache: dict[str, Any] = {}
    if (folder / CONVERSATION_CACHE).exists():
        conversation_cache = json.loads((folder / CONVERSATION_CACHE).read_text())
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
        behind = folder / f"turn{n}.server.response"
        if up_path.exists():  # the server's own bytes, before the proxy
            usage = usage_of(up_path.read_bytes())
            source = "the server's response (tap between proxy and server)"
        elif behind.exists():  # behind a gateway: the server's own bytes to the gateway
            usage = usage_of(behind.read_bytes())
            source = "the server's response to the gateway (tap between gateway and server)"
            server_req = _json((folder / f"turn{n}.server.request").read_bytes().partition(b"\r\n\r\n")[2])
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
        chat = body
        if behind.exists():
            chat = server_req
        if renderer is not None and isinstance(chat, dict) and "messages" in chat:
            toks = renderer.tokens(chat)
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
            # what the turn lost: its own TTFT in the session against the same prompt all cached
            # (the warm TTFT measured straight on the server right after the session)
            entry["measured_lost_s"] = round(max(0.0, timing["t_first_token"] - cal["warm"]["ttft_s"]), 6)
            entry["measured_lost_from"] = "the turn's TTFT in the session minus the same prompt's warm TTFT"
        if cal and cal.get("after_previous") and cal.get("warm_same_nonce"):
            # the same re-prefill replayed straight on the server (the previous turn's prompt then this
            # one, behind a fresh nonce) minus this one all cached: a second measurement, noisier on
            # a busy machine (medians of up to three runs)
            lost = cal["after_previous"]["ttft_s"] - cal["warm_same_nonce"]["ttft_s"]
            entry["replayed_lost_s"] = round(max(0.0, lost), 6)
        kept = (conversation_cache.get("turns") or {}).get(str(n))
        if kept and kept["after_previous"].get("least_ttft_s") is not None and timing["t_first_token"] is not None:
            # what a cache of the conversation would have saved this turn: its TTFT in the session
            # against the same turn on a server that kept the previous one (the least of its runs)
            best = kept["after_previous"]["least_ttft_s"]
            entry["conversation_cache_ttft_s"] = best
            entry["measured_system_only_lost_s"] = round(max(0.0, timing["t_first_token"] - best), 6)
            entry["measured_system_only_lost_from"] = (
                f"the turn's TTFT in the session minus the least TTFT of the same turn on "
                f"{conversation_cache.get('server')} after the previous turn (its cache kept the conversation)"
            )
        if cal and cal["warm"]["ttft_s"] is not None:
            if cal["cold"]["ttft_s"] is not None:
                entry["cold_minus_warm_s"] = round(cal["cold"]["ttft_s"] - cal["warm"]["ttft_s"], 6)
        out.append(entry)
    _add_evidence(out)
    truth = {
        "client": session["client"],
        "client_version": session["client_version"],
        "server": session["server"],
        "server_version": session["server_version"],
        "exchanges": out,
    }
    (folder / "truth.json").write_text(json.dumps(truth, indent=2, ensure_ascii=False) + "\n")
    return truth


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
    """What tells a session's conversation from its side requests: the tools offered and the middle
    of the system prompt (a per-request line at its start, Claude Code's billing line, does not
    change it)."""
    r = rendered(body)
    names = sorted(str((t.get("function") or t).get("name")) for t in body.get("tools") or [] if isinstance(t, dict))
    mid = len(r["system"]) // 2
    return json.dumps([names, r["system"][mid : mid + 200]])


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
        if b is not None and _failed((folder / f"turn{n}.response").read_bytes()):
            # the server failed it (an error status, or an error inside its stream): no turn; the
            # client's retry of it is (OpenCode resent the same body after vllm-mlx's error event)
            out[n] = {"role": "failed", "kind": "error", "conversation": None, "turn": None}
            continue
        if b is None or _key(b) != main:
            kind = (
                "probe" if ex["method"] in ("HEAD", "GET") else "count_tokens" if "count_tokens" in ex["path"] else None
            )
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


def _failed(response: bytes) -> bool:
    """Whether a response is the server's failure: a status other than 200, or an error object in
    its body or stream."""
    head, body = dechunk(response)
    if b" 200 " not in head.split(b"\r\n", 1)[0] + b" ":
        return True
    return any(isinstance(ev, dict) and "error" in ev for ev in events(body))


_HIT = re.compile(r"System KV cache HIT[^:]*: reusing (\d+)")
#: what `record_sessions --conversation-cache` writes: the session's turns on vllm-mlx with a cache
#: that keeps the conversation (``--continuous-batching``)
CONVERSATION_CACHE = "calibration.vllm-mlx-cb.json"
_MISS = re.compile(r"System KV cache MISS[^:]*: will prefill (\d+)")
#: a measured loss is held to 20% only where it stands out of the TTFT noise of these runs: at
#: least this many seconds, the server having re-prefilled at least this share of the prompt
MIN_LOST_S = 0.1
MIN_REPREFILL_SHARE = 0.1


#: the fewest tokens a hidden hit must have reused for a turn to have to name it: the proxy judges no
#: cache below its ``prefix_min_tokens`` (1,024; docs/ANOMALIES.md). Below it the TTFT cannot show the
#: hit: Aider's 624 system tokens on vllm-mlx save ~0.075 s at its cold rate, while the same prompt's
#: TTFT, sent cold and warm straight to the server, varied by more than that (turn 3: 0.255 s cold,
#: 0.296 s warm); such a turn may name it
HIDDEN_HIT_MIN_TOKENS = 1024

#: tokens of the previous prompt a hit may still re-prefill: its generation prompt's tail
#: (``<|im_start|>assistant\n`` and the rig's selector), which the next prompt renders otherwise
TAIL_TOKENS = 8


def server_says(entry: dict[str, Any], previous_prompt: int | None) -> str | None:
    """ "hit", "partial", "miss" from the server's own evidence, or None where it says nothing: its log
    (vllm-mlx's system-prefix cache), or its cached count against the previous turn's prompt
    (mlx_lm.server: a hit re-prefills nothing of the previous prompt but its generation tail)."""
    srv = entry.get("server") or {}
    log = " ".join(srv.get("log") or [])
    if _HIT.search(log):
        return "hit"
    if _MISS.search(log):
        return "miss"
    cached = srv.get("cached_tokens")
    if isinstance(cached, int) and previous_prompt:
        return "hit" if cached >= previous_prompt - TAIL_TOKENS else "partial" if cached > 0 else "miss"
    prompt = srv.get("prompt_tokens")
    if isinstance(cached, int) and previous_prompt is None and isinstance(prompt, int) and prompt > 0:
        return (
            "hit"
            if cached >= prompt - TAIL_TOKENS
            else "miss"
            if cached <= max(TAIL_TOKENS, prompt // 20)
            else "partial"
        )
    return None


def _add_evidence(entries: list[dict[str, Any]]) -> None:
    """Complete each expected verdict with what the server's evidence requires: the names a record
    must carry (``cached_tokens_unreported`` where the log shows a hit the usage denies), the names
    it may carry (``serialized`` for requests that overlapped in time), the seconds a cause lost
    (measured: this TTFT minus the same prompt's warm TTFT; 0 where the server neutralized it)."""
    spans = [
        (e["n"], e["t_sent_session"], e["t_sent_session"] + (e.get("ttft_s") or 0.0))
        for e in entries
        if e.get("expected") and e["request"].startswith("POST")
    ]
    previous: int | None = None  # the previous turn's prompt tokens
    for e in entries:
        want = e.get("expected")
        if not want:
            continue
        srv = e.get("server") or {}
        is_turn = want.get("role") == "turn"
        says = server_says(e, previous if is_turn and want.get("turn", 1) > 1 else None)
        want["server_says"] = says
        if is_turn and previous and isinstance(srv.get("cached_tokens"), int):
            # what the server prefilled again of the previous turn's prompt
            want["reprefilled_tokens"] = max(0, previous - srv["cached_tokens"])
        log = " ".join(srv.get("log") or [])
        if is_turn and want.get("turn", 1) > 1 and not want.get("cause"):
            _system_only(e, want, previous)
        if is_turn:
            previous = srv.get("prompt_tokens")
        must: list[str] = []
        may: list[str] = []
        hit = _HIT.search(log)
        if hit and not srv.get("cached_tokens") and srv.get("prompt_tokens"):
            # its log says it reused the prefix; its usage says 0 cached, or says nothing of it (a
            # turn must say so where the hit is large enough to show; a side request, whose
            # earlier twin is no turn, may)
            shows = want.get("role") == "turn" and int(hit.group(1)) >= HIDDEN_HIT_MIN_TOKENS
            (must if shows else may).append("cached_tokens_unreported")
        want["must_name"] = must
        overlap = any(
            other != e["n"] and a < e["t_sent_session"] + (e.get("ttft_s") or 0.0) and e["t_sent_session"] < b
            for other, a, b in spans
        )
        if want.get("role") == "failed" and srv.get("prompt_tokens") is None:
            must.append("stream_error")  # a 200 stream that carried the server's error
        want["may_name"] = may + (["serialized"] if overlap else [])
        want["lost_s"] = None
        if want.get("cause") == "cache_system_only":
            lost = e.get("measured_system_only_lost_s")
            want["lost_s"] = lost if lost is not None and lost >= MIN_LOST_S else None
        elif want.get("role") == "turn" and want.get("cause"):
            if says == "hit":
                want["lost_s"] = 0.0  # neutralized by the server (e.g. vllm-mlx strips the billing line)
            elif (
                e.get("measured_lost_s") is not None
                and e["measured_lost_s"] >= MIN_LOST_S
                and (want.get("reprefilled_tokens") or 0) >= MIN_REPREFILL_SHARE * (srv.get("prompt_tokens") or 0) > 0
            ):
                want["lost_s"] = e["measured_lost_s"]


def _system_only(entry: dict[str, Any], want: dict[str, Any], previous: int | None) -> None:
    """A turn that extends the previous one (the bytes name no cause) on a server whose log says it
    reused its system prompt only (vllm-mlx's ``System KV cache HIT: reusing N tokens, prefilling M
    new``): the previous prompt past those N tokens was prefilled again, the cause
    ``cache_system_only``, where that is at least ``HIDDEN_HIT_MIN_TOKENS`` (the least the proxy
    judges) and ``MIN_REPREFILL_SHARE`` of the prompt."""
    srv = entry.get("server") or {}
    hit = _HIT_PREFILLING.search(" ".join(srv.get("log") or []))
    if hit is None:
        return
    reused, prefilled = int(hit.group(1)), int(hit.group(2))
    again = previous - reused if previous else prefilled  # (no prompt figure: at most what it prefilled)
    prompt = srv.get("prompt_tokens") or reused + prefilled
    if again >= HIDDEN_HIT_MIN_TOKENS and again >= MIN_REPREFILL_SHARE * prompt:
        want.update(cause="cache_system_only", at=None, reprefilled_tokens=again)


_HIT_PREFILLING = re.compile(r"System KV cache HIT[^:]*: reusing (\d+) tokens, prefilling (\d+) new")


def summary_table(folder: Path) -> str:
    """A Markdown table of the session: per exchange, what was sent, the server's word, the TTFTs,
    the expected verdict and what mlxproxy said when it was recorded."""
    truth = json.loads((folder / "truth.json").read_text())
    rows = [
        "| # | request | role | server says | prompt / cached (common prefix) | TTFT s (cold / warm same prompt) "
        "| expected cause (lost s) | mlxproxy when recorded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in truth["exchanges"]:
        want = e.get("expected") or {}
        srv = e.get("server") or {}
        cal = e.get("calibration") or {}
        log = " ".join(srv.get("log") or [])
        m = _HIT.search(log) or _MISS.search(log)
        says = want.get("server_says") or ""
        if m:
            says += f" ({'reusing' if 'HIT' in m.group(0) else 'prefill'} {m.group(1)} system tokens)"
        tokens = f"{srv.get('prompt_tokens')} / {srv.get('cached_tokens')}"
        if srv.get("common_prefix_tokens") is not None:
            tokens += f" ({srv['common_prefix_tokens']})"
        ttft = f"{e.get('ttft_s')}"
        if cal:
            ttft += f" ({cal['cold']['ttft_s']} / {cal['warm']['ttft_s']})"
        role = want.get("role", "")
        if role == "turn":
            role = f"turn {want.get('turn')}"
        elif role == "side":
            role = f"side: {want.get('kind')}"
        cause = want.get("cause") or "none"
        if want.get("at"):
            cause += f" at {want['at']}"
        if want.get("lost_s") is not None:
            cause += f" ({want['lost_s']})"
        if want.get("must_name"):
            cause += "; must name " + ", ".join(want["must_name"])
        today = e.get("mlxproxy_today") or {}
        said = f"conv {str(today.get('conversation_id'))[:6]} turn {today.get('turn')}"
        if today.get("reprefill_cause"):
            said += f", {today['reprefill_cause']} at {today.get('reprefill_at')}"
        if today.get("anomalies"):
            said += ", " + ", ".join(today["anomalies"])
        rows.append(f"| {e['n']} | {e['request']} | {role} | {says} | {tokens} | {ttft} | {cause} | {said} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    write_truth(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)


#: what to notice in each client's requests turn to turn (from diffing their bytes; FINDINGS.md)
NOTES: dict[str, str] = {
    "claude-code": (
        "Claude Code (`claude -p`, then `claude -c -p`) sends `POST /v1/messages?beta=true`, one per turn (no "
        "count_tokens, no probes: `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`). `system` is a list of text "
        "blocks whose first is `x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli;`, "
        "the same on every request here (no per-request values against a base URL it does not take for "
        "Anthropic's). `messages` holds the first user message (two text blocks: a reminder, the prompt), then "
        "a `system`-role message (the environment), then the turns. Each request moves its `cache_control` "
        "breakpoint to the newest message, and re-sends the previous newest one (the environment message, "
        "then each user message) as a plain string with the same text. As the server renders it (markers "
        "dropped, a one-text-block list the same as a string) every turn extends the previous one: one "
        "conversation, no cause. The headers name the client (`User-Agent: claude-cli/2.1.332 (external, "
        "sdk-cli)`), the session (`X-Claude-Code-Session-Id`, the same on every turn) and the request class "
        "(`x-claude-code-request-class: main`). On vllm-mlx its system-prefix cache missed on turn 1 and hit "
        "on every later turn (27,435 tokens reused); vllm-mlx's Messages stream reports no prompt tokens."
    ),
    "claude-code-billing": (
        "The same as claude-code, with `_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL=1`: system line 1 now carries "
        "per-request values, `x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; "
        "cch=<5 hex>; cc_prompt_id=<uuid>; cc_turn_origin=sdk; cc_prompt_index=0; cc_turn_index=N;` "
        "(`cch` and `cc_prompt_id` change on every request, `cc_turn_index` counts the turns): a volatile span "
        "at system line 1, everything else as without it. vllm-mlx strips that line before caching "
        "(`api/prompt_canonicalize.py`) and its log says HIT on turns 2-4: present, neutralized, 0 s lost."
    ),
    "claude-code-billing-off": (
        "The same as claude-code-billing plus `CLAUDE_CODE_ATTRIBUTION_HEADER=0`: the billing block is gone "
        "from `system` altogether (three blocks, not four): the fix users apply works in 2.1.332. Every turn "
        "extends the previous one; vllm-mlx hits on turns 2-4."
    ),
    "codex": (
        "Codex (`codex exec`, then `codex exec resume --last`) sends `POST /v1/responses`: `instructions` "
        "absent, two developer and two user `input` items on turn 1, 9 tools, `prompt_cache_key` = the session "
        "id, and `client_metadata` with per-turn ids and a timestamp (it changes on every request but never "
        "reaches the prompt). Each turn's `input` strictly extends the previous one's. The headers carry "
        "`session-id` (constant) and `x-codex-turn-metadata` (per turn, `history_initialization: cold_resume` "
        "on resumed turns). vllm-mlx logs HIT on turns 2-4 (15,028 system tokens reused) and reports "
        "`cached_tokens: 0` in the usage: `cached_tokens_unreported`, never `cache_evicted`."
    ),
    "aider": (
        "Aider (`aider --message ... --restore-chat-history`) sends one chat completion per turn, no tools, no "
        "`stream_options` (the proxy injects them and keeps the usage off the client's stream). Each turn "
        "inserts the restored history (previous user prompts with a trailing `  \\n`, and the answers) "
        'before its fixed pair "I am not sharing any files that you can edit yet." / "Ok.", and drops '
        "the reminder it appended to the previous last user message: the prompt diverges at `messages[5]` on "
        "turn 2 (`messages[7]` on turn 3, `[9]` on turn 4): `history_rewritten`. mlx_lm.server reuses exactly "
        "the common token prefix (853 of 1,381 on turn 2) and re-prefills the rest every turn. On vllm-mlx, "
        "whose cache keeps only the system prefix, the rewrite costs nothing more than its usual suffix prefill."
    ),
    "opencode": (
        "OpenCode (`opencode run`, then `opencode run --continue`) sends a title request first (its own "
        'system prompt "You are a title generator...", no tools: a side request), then one streamed chat '
        "completion per turn with 10 tools and `stream_options.include_usage`; each turn strictly extends the "
        "previous one. Headers: `User-Agent: opencode/1.18.33 ...`, `x-session-id` (constant)."
    ),
    "qwen-code": (
        "Qwen Code (`qwen PROMPT`, then `qwen --continue PROMPT`, `--auth-type openai`) sends two requests per "
        'turn: the turn itself (10 tools) and, after it, a memory-extraction side request ("You are now '
        'acting as the managed memory extraction subagent...", 6 other tools) that re-sends the conversation. '
        "On each continued turn the date reminder (`<system-reminder>The current date is ...`) moves: it is "
        "dropped from the previous last user message and appended to the new one, so the turn diverges near "
        "the end of the previous last user message (`messages[1]` on turn 2): `history_rewritten`, a few "
        "dozen tokens re-prefilled (mlx_lm.server: cached = the common token prefix). Header: "
        "`user-agent: QwenCode/0.24.4 (linux; x64)`."
    ),
    "llm": (
        "llm (`llm prompt -m local PROMPT`, then `llm prompt -c PROMPT`) sends a bare streamed chat completion "
        "(no system prompt, no tools, `stream_options.include_usage`), each turn the whole conversation so "
        "far: a strict extension every turn. Header: `user-agent: OpenAI/Python 3.63.0` (it does not name "
        "itself)."
    ),
    "opencode-paste": "OpenCode (`opencode run`, then `opencode run --continue`) with a document pasted into the "
    "first prompt (the project's docs, 110,000 characters: ~62,000 tokens of conversation after its ~17,100-token "
    "system prompt and tools); a title side request first (with the paste), then each turn strictly extends the "
    "previous. On vllm-mlx 0.6.0 each later turn logs `System KV cache HIT: reusing 17096 tokens, prefilling 62203 "
    "new`: the system part is reused, the whole conversation prefilled again; the TTFT shows it (1.85, 1.10, 1.28 s "
    "against 2.26 s cold), and from it the proxy learns that this server keeps the system prompt only: from the "
    "second turn that shows it, the loss is `cache_system_only` (the same turns on vllm-mlx --continuous-batching, "
    "whose cache keeps the conversation: `calibration.vllm-mlx-cb.json`, what they would have taken). Its first "
    "request with the paste got an error event from vllm-mlx (its title request was being served) and OpenCode "
    "sent the same body again: the retry is turn 1.",
}


#: what the server adds to it
SERVER_NOTES: dict[str, str] = {
    "mlx-lm+litellm": (
        "Here the client talks to LiteLLM's proxy (1.108.7, `hosted_vllm/default_model`, chat completions "
        "API, as `shared/fixtures/real2/harness/litellm_config.yaml` had it), which translates to chat "
        "completions for mlx_lm.server (which serves neither Messages nor Responses): `turnN.server.*` is "
        "what LiteLLM sent the server and got back. mlx_lm.server strips nothing: what the client changes "
        "in the prompt is re-prefilled from there on (its `cached_tokens` = the common token prefix of the "
        "translated prompts; the rig's chat template renders the tools before the system prompt)."
    ),
    "vllm-mlx": (
        "vllm-mlx 0.6.0 caches the system prefix (tools and system prompt as rendered) and logs "
        "`System KV cache HIT/MISS` per request; the messages after it are prefilled every time."
    ),
}


def write_readme(folder: Path) -> None:
    """The folder's README.md: software, versions, the exact commands, what to notice, the table."""
    session = json.loads((folder / "session.json").read_text())
    cmds = []
    for inv in session["invocations"]:
        argv = [re.sub(r"http://127\.0\.0\.1:\d+", "$TAP", a) for a in inv["argv"]]
        cmds.append("    " + " ".join(json.dumps(a) if (" " in a or not a) else a for a in argv))
    env = "\n".join(
        f"    {k}={re.sub(r'http://127[.]0[.]0[.]1:[0-9]+', '$TAP', v)}"
        for k, v in session["env"].items()
        if k not in ("NO_PROXY", "no_proxy", "PWD") and not k.startswith("XDG_")
    )
    text = f"""# {session["client"]} {session["client_version"]} on {session["server_version"]}

Recorded {session["recorded"]} on {session["platform"]} by `tests/integration/record_sessions.py`
(`python -m tests.integration.record_sessions --server {session["server"]} --client {session["client"]}`, inside
`unshare -n` with only loopback up): the client ran {len(session["invocations"])} times in
`{session["work"]}` with HOME `{session["home"]}`, through a byte tap (`$TAP`) in front of
`mlxproxy serve` ({session.get("proxy", "a fresh one for this session")}, capture on), which forwarded to
a second tap in front of the server. The model is the rigged tiny model (`tests/integration/rigged.py`, fixed to one answer:
`<think>...</think>` then "It is sunny today."), served as `{session["model"]}`.

Commands, in order (`$TAP` is the tap's URL):

{chr(10).join(cmds)}

Environment set for the client (besides a loopback-only proxy setting; keys are dummies):

{env}

## What to notice

{NOTES.get(session["client"], "(see FINDINGS.md)")}

{SERVER_NOTES.get(session["server"], "")}

## Files

Per HTTP exchange N, in the order sent: `turnN.headers` (request line and headers), `turnN.request.json`
(the body, exact bytes), `turnN.response` (status, headers and body as the proxy sent them, chunked
framing kept), `turnN.response.marks.json` (byte offset and arrival time, seconds after the request,
of each read), `turnN.timing.json` (`t_sent_session` from the session's start; `t_first_byte`,
`t_first_token` (the first token-bearing event) and `t_end`, seconds after the request);
`turnN.upstream.request` / `.response` / `.marks.json`: what the proxy sent the server and got back
(behind a gateway: `turnN.server.*`, what the gateway sent the server). `records.jsonl`: the proxy's
capture lines (what mlxproxy said when it was recorded); `server.log`: the server's log lines during
the session, each with its arrival time; `calibration.json`: each generation request sent again
straight to the server, cold (a nonce at the prompt's start) and warm (the exact body, cached);
`calibration.vllm-mlx-cb.json` / `calibration.vllm-mlx-trie.json` (where present): each turn sent again
after the previous one to vllm-mlx with `--continuous-batching` / `--prefix-trie-cache`, a cache meant to
keep the conversation (`record_sessions --conversation-cache`); `truth.json`: per exchange the server's truth, the body's difference from the previous request, the
expected verdict and what mlxproxy said (`tests/integration/sessiontruth.py` writes it).

## The session

{summary_table(folder)}"""
    (folder / "README.md").write_text(text)
