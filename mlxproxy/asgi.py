"""The ASGI types the proxy and the simulator are written against (ASGI 3, HTTP and lifespan).

Both are pure ASGI applications; these aliases replace `Any` on their arguments. A scope
and a message are mappings whose keys depend on their `type` (the ASGI specification lists
them), so their values stay `Any`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["Scope", "Message", "Receive", "Send", "ASGIApp", "Headers"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]  # raw header pairs, names lower-case in a scope
