"""Header policy: which headers the proxy drops, adds, redacts or never re-sends.

Pure data, shared by the proxy (`proxy/app.py`, `proxy/auth.py`), the capture writer
(`capture.py`) and the measuring client, so each rule is written once. Names are
lower-case; the proxy compares raw ASGI header names (bytes, already lower-case), the
capture and the client compare `str` names, so each set comes in the form its reader uses.
"""

from __future__ import annotations

__all__ = [
    "REPLAY_HEADER",
    "REPLAY_HEADER_B",
    "REQUEST_ID_HEADER",
    "HOP_BY_HOP",
    "REQUEST_DROP",
    "RESPONSE_DROP",
    "CLIENT_KEY_HEADERS",
    "DEFAULT_REDACT",
    "REDACTED",
    "NOT_RESENT",
    "upstream_request_headers",
]

#: set by `mlxproxy replay`/`bench` on every request they send; the proxy tags the record
#: `replay` and does not forward the header
REPLAY_HEADER = "x-mlxproxy-replay"
REPLAY_HEADER_B = REPLAY_HEADER.encode()
#: added by the proxy to every forwarded response (and its own error answers): the record's id
REQUEST_ID_HEADER = b"x-mlxproxy-request-id"

#: hop-by-hop headers (RFC 9110 7.6.1 and the older `keep-alive`, `proxy-*`): one connection's business
_HOP = (
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
)
HOP_BY_HOP = frozenset(h.encode() for h in _HOP)
#: request headers never forwarded upstream: hop-by-hop, the framing the proxy sets itself
#: (`host`, `content-length`), `accept-encoding` (the proxy asks for identity: the meter reads
#: the bytes it forwards) and the replay tag
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", REPLAY_HEADER_B}
#: response headers never passed to the client (the server in front frames the body itself)
RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"trailer"}
)
#: where a client puts the proxy's own key; removed before forwarding when the proxy has a key
CLIENT_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})

#: header values replaced by `REDACTED` in captures and scrubbed from error texts (plus the
#: configured `redact_headers`)
DEFAULT_REDACT = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"})
REDACTED = "[REDACTED]"

#: captured request headers the measuring client never sends as given: hop-by-hop and framing
#: headers, and the ones it sets itself (`accept-encoding`, the replay tag)
NOT_RESENT = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "upgrade",
        "accept-encoding",
        "proxy-authorization",
        REPLAY_HEADER,
    }
)


def upstream_request_headers(
    headers: list[tuple[bytes, bytes]], drop: frozenset[bytes], auth_header: bytes | None
) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The headers to send upstream for a client's `headers`, and whether the request carried
    the replay tag. `drop` is `REQUEST_DROP` (plus `CLIENT_KEY_HEADERS` when the proxy has a
    key); the names the client's `Connection` header lists are dropped too. With the
    upstream's own `auth_header`, the client's `authorization` is replaced by it."""
    listed: set[bytes] = set()
    for k, v in headers:
        if k == b"connection":
            listed.update(x.strip().lower() for x in v.split(b","))
    out: list[tuple[bytes, bytes]] = []
    replay = False
    for k, v in headers:
        if k == REPLAY_HEADER_B:
            replay = True
        if k in drop or k in listed:
            continue
        if auth_header is not None and k == b"authorization":
            continue
        out.append((k, v))
    out.append((b"accept-encoding", b"identity"))  # the meter reads the bytes it forwards
    if auth_header is not None:
        out.append((b"authorization", auth_header))
    return out, replay
