"""Configuration: a YAML file (every key documented in config.example.yaml), CLI overrides.

`load_config(path, overrides)` returns a frozen `Config` or raises `ConfigError` with one
sentence naming the key and what is allowed. Unknown keys are errors, not ignored: a typo
in a config file should never silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union
from urllib.parse import urlsplit

import yaml

from mlxproxy.core.detect import Thresholds
from mlxproxy.errors import ConfigError

__all__ = [
    "Config",
    "UpstreamConfig",
    "TimeoutConfig",
    "Thresholds",
    "load_config",
    "build_config",
    "proxy_api_key",
    "is_loopback_host",
    "parse_upstream_url",
]

DEFAULT_UPSTREAM_URL = "http://127.0.0.1:8080"  # mlx_lm.server's default port


@dataclass(frozen=True)
class UpstreamConfig:
    """One upstream server. `models` are glob patterns (fnmatch) matched against the
    request's `model`; `api_key_env` names an environment variable holding its key."""

    name: str
    url: str
    api_key_env: str | None = None
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class TimeoutConfig:
    """Seconds. `connect_s` bounds opening a connection to an upstream; `read_s` is the
    longest silence allowed between two reads from the upstream, the wait for headers
    included: a 30-minute prefill on a long prompt is legitimate. 0 means no limit."""

    connect_s: float = 10.0
    read_s: float = 1800.0


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8000
    upstreams: tuple[UpstreamConfig, ...] = ()
    default_upstream: str | None = None
    inject_usage: bool = True
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    detectors: Thresholds = field(default_factory=Thresholds)
    recent_records: int = 200
    max_model_labels: int = 20
    max_request_body_bytes: int = 64 * 1024 * 1024
    log_requests: bool = True
    tokenizer: str | None = None
    tokenizer_search: bool = True
    capture: str | None = None
    capture_responses: bool = False
    capture_prompts: bool = True
    capture_queue_size: int = 10000
    capture_queue_bytes: int = 64 * 1024 * 1024
    max_request_header_bytes: int = 64 * 1024
    max_request_headers: int = 100
    request_header_timeout_s: float = 10.0
    redact_headers: tuple[str, ...] = ()
    proxy_api_key_env: str | None = None
    metrics_need_key: bool = True

    def default(self) -> UpstreamConfig:
        for up in self.upstreams:
            if up.name == self.default_upstream:
                return up
        return self.upstreams[0]


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 4
_SHOW.maxlevel = 2


def _show(value: Any) -> str:
    """A short repr of a config value for an error message: bounded whatever its size."""
    return _SHOW.repr(value)


MAX_YAML_NODES = 10_000  # nodes a config may expand to, aliases counted at each use


class _BoundedLoader(yaml.SafeLoader):
    """A safe loader that refuses documents whose aliases expand past MAX_YAML_NODES nodes
    (a "billion laughs" file), before anything walks the expanded value."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        weights: dict[int, int] = {}

        def weight(n: Any) -> int:
            w = weights.get(id(n))
            if w is not None:
                return w
            weights[id(n)] = MAX_YAML_NODES + 1  # a cycle counts as too large
            w = 1
            if isinstance(n, yaml.SequenceNode):
                for child in n.value:
                    w += weight(child)
                    if w > MAX_YAML_NODES:
                        break
            elif isinstance(n, yaml.MappingNode):
                for k, v in n.value:
                    w += weight(k) + weight(v)
                    if w > MAX_YAML_NODES:
                        break
            weights[id(n)] = w
            return w

        if node is not None and weight(node) > MAX_YAML_NODES:
            raise ConfigError(
                f"expands to more than {MAX_YAML_NODES} values through YAML aliases; write it out plainly"
            )
        return node


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    return str(tp)


def _convert(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(key, args[0], value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"config key '{key}' must be a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}"
            )
        return _build(tp, value, key + ".")
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list")
        return tuple(_convert(f"{key}[{i}]", inner, v) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {_show(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string, got {_show(value)}")
        return value
    raise ConfigError(f"config key '{key}' has an unsupported type")  # pragma: no cover


def _build(cls: Any, raw: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            shown = key if isinstance(key, str) and len(key) <= 60 and key.isprintable() else _show(key)
            raise ConfigError(f"unknown config key '{prefix}{shown}'; allowed here: {', '.join(names)}")
        kwargs[key] = _convert(prefix + key, hints[key], value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        raise ConfigError(
            f"config section '{prefix.rstrip('.') or 'top level'}' needs key(s): {', '.join(missing)}"
        ) from exc


def _check_url(key: str, url: str) -> None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ConfigError(f"config key '{key}' is not a valid URL ({exc}): {_show(url)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"config key '{key}' must be an http:// or https:// URL with a host, got {_show(url)}")
    if parts.query or parts.fragment or any(c.isspace() or not c.isprintable() for c in url):
        raise ConfigError(
            f"config key '{key}' must be a plain base URL (no query, fragment, spaces or control "
            f"characters), got {_show(url)}"
        )
    try:
        url.encode("ascii")
    except UnicodeEncodeError:
        raise ConfigError(
            f"config key '{key}' must be written in ASCII (percent-encode other characters), got {_show(url)}"
        ) from None


def _check_number(key: str, v: float, *, minimum: float = 0.0) -> None:
    if not math.isfinite(v) or v < minimum:
        raise ConfigError(f"config key '{key}' must be a finite number >= {minimum:g}, got {_show(v)}")


def _validate(cfg: Config) -> None:
    if not (0 <= cfg.port <= 65535):
        raise ConfigError(f"config key 'port' must be between 0 and 65535, got {cfg.port}")
    if not cfg.host or not cfg.host.isprintable() or " " in cfg.host:
        raise ConfigError(f"config key 'host' must be an address or host name, got {_show(cfg.host)}")
    if not cfg.upstreams:
        raise ConfigError("config key 'upstreams' must list at least one upstream")
    seen: set[str] = set()
    for i, up in enumerate(cfg.upstreams):
        if not up.name or up.name in seen or len(up.name) > 64 or not up.name.isprintable():
            raise ConfigError(
                f"config key 'upstreams[{i}].name' must be a unique, printable name of 1-64 characters, "
                f"got {_show(up.name)}"
            )
        seen.add(up.name)
        _check_url(f"upstreams[{i}].url", up.url)
        parse_upstream_url(up.url, f"config key 'upstreams[{i}].url'")
        if up.api_key_env is not None and not up.api_key_env:
            raise ConfigError(f"config key 'upstreams[{i}].api_key_env' must name an environment variable")
    if cfg.default_upstream is not None and cfg.default_upstream not in seen:
        raise ConfigError(
            f"config key 'default_upstream' must be one of the upstream names ({', '.join(sorted(seen))}), "
            f"got {_show(cfg.default_upstream)}"
        )
    for name, section in (("timeouts", cfg.timeouts), ("detectors", cfg.detectors)):
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _check_number(f"{name}.{f.name}", v)
    _check_number("request_header_timeout_s", cfg.request_header_timeout_s)
    if cfg.proxy_api_key_env is not None and not cfg.proxy_api_key_env:
        raise ConfigError("config key 'proxy_api_key_env' must name an environment variable")
    for key, minimum in (
        ("recent_records", 0),
        ("max_model_labels", 1),
        ("max_request_body_bytes", 1),
        ("capture_queue_size", 1),
        ("capture_queue_bytes", 1),
        ("max_request_header_bytes", 1024),
        ("max_request_headers", 1),
    ):
        v = getattr(cfg, key)
        if v < minimum:
            raise ConfigError(f"config key '{key}' must be at least {minimum}, got {v}")


def parse_upstream_url(url: str, what: str = "the upstream URL") -> tuple[str, str | None]:
    """Check a server's base URL (the proxy's upstream, a replay/bench target) and
    normalize it; the one place every command parses such a URL.

    Returns `(base_url, note)`: the URL without a trailing `/` and without its `/v1` and
    anything after it (clients' URLs end in `/v1`, but request paths already start with it,
    so keeping it would send `/v1/v1/...`; an endpoint's whole URL, `/v1/chat/completions`,
    would send every request to one wrong path), and a one-line note saying so when a
    path was dropped (else None). Raises `ConfigError` naming `what` for anything that cannot be
    connected to: another scheme, no host, a port that is not a number in 1..65535, a
    query or fragment.
    """
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what} must be http://HOST[:PORT], got {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{what} must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8080, got {url!r}"
        )
    if port == 0:
        raise ConfigError(f"{what} must not use port 0, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{what} must not have a query or fragment, got {url!r}")
    path = parts.path.rstrip("/")
    note = None
    segments = path.split("/")
    if "v1" in segments:  # `.../v1` or an endpoint's whole URL, `.../v1/chat/completions`
        beyond = "/".join(segments[segments.index("v1") :])
        path = "/".join(segments[: segments.index("v1")])
        note = (
            f"{what} {url!r} ends in /{beyond}; using {parts.scheme}://{parts.netloc}{path} "
            "(request paths already start with /v1)"
        )
    return f"{parts.scheme}://{parts.netloc}{path}", note


def proxy_api_key(cfg: Config) -> bytes | None:
    """The key clients must present (from the environment variable `proxy_api_key_env`
    names), or None when no key is configured. Raises `ConfigError` when the variable is
    unset or empty: a proxy meant to be protected never starts open."""
    if cfg.proxy_api_key_env is None:
        return None
    value = os.environ.get(cfg.proxy_api_key_env, "").strip()
    if not value:
        raise ConfigError(
            f"config key 'proxy_api_key_env' names {cfg.proxy_api_key_env}, which is not set in the "
            "environment; export it with the key clients must send, or remove the config key"
        )
    return value.encode()


def is_loopback_host(host: str) -> bool:
    """True when `host` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_config(raw: dict[str, Any] | None = None, *, upstream_url: str | None = None, **overrides: Any) -> Config:
    """A validated `Config` from a parsed YAML mapping plus CLI overrides (None = not given).

    `upstream_url` replaces the configured upstreams with one named `default`.
    """
    raw = dict(raw or {})
    for key, value in overrides.items():
        if value is not None:
            raw[key] = value
    if upstream_url is not None:
        raw["upstreams"] = [{"name": "default", "url": upstream_url}]
        raw.pop("default_upstream", None)
    raw.setdefault("upstreams", [{"name": "default", "url": DEFAULT_UPSTREAM_URL}])
    cfg: Config = _build(Config, raw)
    _validate(cfg)
    return cfg


def load_config(path: str | os.PathLike[str] | None, *, upstream_url: str | None = None, **overrides: Any) -> Config:
    """Read YAML at `path` (None: no file) and apply CLI overrides."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}") from exc
        try:
            raw = yaml.load(text, Loader=_BoundedLoader) or {}  # a SafeLoader subclass: plain data only
        except ConfigError as exc:
            raise ConfigError(f"config file {str(p)!r} {exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of keys at the top level")
    return build_config(raw, upstream_url=upstream_url, **overrides)
