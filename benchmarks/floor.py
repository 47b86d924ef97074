"""The floor: the least a Python proxy on mlxproxy's stack can cost.

A pure ASGI app on the same server stack as `mlxproxy serve` (uvicorn with httptools and
uvloop) and the same upstream client (the proxy's own transport, `mlxproxy.proxy.transport`:
one keep-alive pool, no timeouts) that forwards each upstream read to the client and does
nothing else: no metering, no metrics, no routing, no header filtering beyond what HTTP
requires. `run.py --floor` runs it as one more target, so the report shows how much of
mlxproxy's cost is the stack and how much its own work. Not a usable proxy. (Until the proxy
had its own transport the floor's client was an aiohttp session: benchmarks/README.md, "a lean
upstream transport", measures both.)

    python benchmarks/floor.py --upstream http://127.0.0.1:PORT --port PORT
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from mlxproxy.proxy.transport import Pool

DROP = frozenset({b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length"})
DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})


class Floor:
    def __init__(self, upstream: str) -> None:
        self.pool = Pool("floor", upstream.rstrip("/"), connect_s=None, read_s=None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await self.pool.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        target = scope["raw_path"]
        if scope["query_string"]:
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k not in DROP]
        conn = await self.pool.open(scope["method"], target, headers, body)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": conn.status,
                    "headers": [(k, v) for k, v in conn.headers if k.lower() not in DROP_RESPONSE],
                }
            )
            read = conn.read
            while chunk := await read():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            conn.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    from mlxproxy.edge.runner import stack_settings  # the proxy's own choice of stack (MLXPROXY_STACK)

    loop, http = stack_settings()
    uvicorn.run(
        Floor(a.upstream),
        host="127.0.0.1",
        port=a.port,
        loop=loop,
        http=http,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
