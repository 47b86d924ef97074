"""The project's exceptions. Third-party exceptions are translated at the shell boundary.

MlxproxyError                 base; `str(exc)` is one sentence a user can act on
├── ConfigError               a bad config file, key or value (CLI exit code 2)
├── CaptureFormatError        a capture file that cannot be read (unknown version, bad line)
├── UpstreamError             the proxy could not get a response from an upstream
│   ├── UpstreamUnreachable   connection refused / reset before any response (HTTP 502)
│   └── UpstreamTimeout       no response or no byte within the timeout (HTTP 504)
└── UpstreamBodyError         the response started, then its body broke (reset, bad framing)
    └── UpstreamBodyTimeout   ... or went silent for longer than the read timeout

`error_body` is the one builder of the OpenAI-shaped JSON error the proxy answers with.
"""

from __future__ import annotations

import orjson

from mlxproxy.core.record import Outcome


def error_body(message: str, code: str, err_type: str = "proxy_error") -> bytes:
    """The OpenAI-shaped error body: `{"error": {"message", "type", "code", "param"}}`."""
    return orjson.dumps({"error": {"message": message, "type": err_type, "code": code, "param": None}})


class MlxproxyError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(MlxproxyError):
    """The configuration is invalid; the message names the key and what is allowed."""


class CaptureFormatError(MlxproxyError):
    """A capture file cannot be read."""


class UpstreamError(MlxproxyError):
    status = 502
    outcome: Outcome = "upstream_unreachable"  # the record's outcome
    code = "upstream_unreachable"


class UpstreamUnreachable(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    status = 504
    outcome: Outcome = "upstream_timeout"
    code = "upstream_timeout"


class UpstreamBodyError(MlxproxyError):
    """The upstream's response body ended abnormally after the response had started."""


class UpstreamBodyTimeout(UpstreamBodyError):
    """The upstream's response body went silent for longer than the read timeout."""
