"""The proxy's own key, and keeping secrets out of everything the proxy writes.

With `proxy_api_key_env` set, a request must carry the key as `Authorization: Bearer <key>`
or `x-api-key: <key>`; it is compared as SHA-256 digests in constant time. `Scrubber`
replaces every known secret in a text headed for logs, captures, `/streams` or a client.
"""

from __future__ import annotations

import hashlib
import hmac

from mlxproxy.headers import CLIENT_KEY_HEADERS, DEFAULT_REDACT, REDACTED

__all__ = ["KeyCheck", "Scrubber", "CLIENT_KEY_HEADERS"]


class KeyCheck:
    """Does a request carry the proxy key?"""

    def __init__(self, key: bytes) -> None:
        self._digest = hashlib.sha256(key).digest()

    def __call__(self, headers: list[tuple[bytes, bytes]]) -> bool:
        ok = False
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                v = v[7:]
            elif k != b"x-api-key":
                continue
            ok |= hmac.compare_digest(hashlib.sha256(v.strip()).digest(), self._digest)
        return ok


class Scrubber:
    """Replaces known secrets: the proxy key, upstream keys and URL passwords (`secrets`),
    and the values of a request's redacted headers (an upstream may echo them)."""

    def __init__(self, secrets: tuple[str, ...], redact_headers: tuple[str, ...] | list[str] = ()) -> None:
        self._secrets = secrets
        self._redact = DEFAULT_REDACT | {h.lower() for h in redact_headers}

    def __call__(self, text: str, headers: list[tuple[bytes, bytes]]) -> str:
        secrets = list(self._secrets)
        for k, v in headers:
            if k.decode("latin-1") in self._redact:
                value = v.decode("latin-1").strip()
                secrets.append(value)
                if value[:7].lower() == "bearer ":
                    secrets.append(value[7:].strip())
        for secret in sorted(secrets, key=len, reverse=True):
            if len(secret) >= 4 and secret in text:
                text = text.replace(secret, REDACTED)
        return text
