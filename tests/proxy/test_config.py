from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mlxproxy.cli import main
from mlxproxy.config import Config, build_config, load_config
from mlxproxy.errors import ConfigError
from support import REPO

EXAMPLE = REPO / "config.example.yaml"


def test_example_config_loads_and_documents_every_key() -> None:
    cfg = load_config(EXAMPLE)
    assert [u.name for u in cfg.upstreams] == ["mlx-lm", "omlx"] and cfg.default().name == "mlx-lm"
    raw = yaml.safe_load(EXAMPLE.read_text())

    def check(cls, section: dict, where: str) -> None:
        for f in dataclasses.fields(cls):
            assert f.name in section, f"config.example.yaml lacks {where}{f.name}"

    check(Config, raw, "")
    check(type(cfg.timeouts), raw["timeouts"], "timeouts.")
    check(type(cfg.detectors), raw["detectors"], "detectors.")
    # defaults in the example are the real defaults (except the marked examples)
    default = build_config({})
    assert cfg.timeouts == default.timeouts and cfg.detectors == default.detectors
    assert (cfg.host, cfg.port, cfg.inject_usage, cfg.recent_records) == (
        default.host,
        default.port,
        default.inject_usage,
        default.recent_records,
    )


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"prot": 1}, "unknown config key 'prot'"),
        ({"port": "x"}, "'port' must be an integer"),
        ({"port": 70000}, "'port' must be between 0 and 65535"),
        ({"timeouts": {"read": 5}}, "unknown config key 'timeouts.read'"),
        ({"upstreams": [{"name": "a", "url": "ftp://x"}]}, "'upstreams[0].url' must be an http"),
        ({"upstreams": [{"url": "http://x"}]}, "needs key(s): name"),
        ({"upstreams": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "unique"),
        ({"default_upstream": "zz"}, "'default_upstream' must be one of"),
        ({"inject_usage": "yes"}, "'inject_usage' must be true or false"),
        ({"detectors": {"stall_factor": -1}}, "'detectors.stall_factor' must be a finite number >= 0"),
        # every value is validated at start (issue 21)
        ({"timeouts": {"read_s": float("nan")}}, "'timeouts.read_s' must be a finite number >= 0, got nan"),
        ({"timeouts": {"connect_s": float("inf")}}, "'timeouts.connect_s' must be a finite number >= 0, got inf"),
        ({"detectors": {"usage_ratio": float("nan")}}, "'detectors.usage_ratio' must be a finite number"),
        ({"request_header_timeout_s": float("inf")}, "'request_header_timeout_s' must be a finite number"),
        ({"capture_queue_size": 0}, "'capture_queue_size' must be at least 1, got 0"),
        ({"capture_queue_size": -1}, "'capture_queue_size' must be at least 1, got -1"),
        ({"capture_queue_bytes": 0}, "'capture_queue_bytes' must be at least 1"),
        ({"max_request_header_bytes": 10}, "'max_request_header_bytes' must be at least 1024"),
        ({"max_request_headers": 0}, "'max_request_headers' must be at least 1"),
        ({"upstreams": [{"name": "a", "url": "http://[::1:8080"}]}, "'upstreams[0].url' is not a valid URL"),
        ({"upstreams": [{"name": "a", "url": "http://127.0.0.1:99999"}]}, "'upstreams[0].url' is not a valid URL"),
        (
            {"upstreams": [{"name": "a", "url": "http://"}]},
            "'upstreams[0].url' must be an http:// or https:// URL with a host",
        ),
        ({"upstreams": [{"name": "a", "url": "http://h/x?y=1"}]}, "'upstreams[0].url' must be a plain base URL"),
        ({"upstreams": [{"name": "a", "url": "http://h\n/x"}]}, "'upstreams[0].url' must be a plain base URL"),
        ({"upstreams": [{"name": "a\x1b[31m", "url": "http://h"}]}, "'upstreams[0].name' must be a unique, printable"),
        ({"host": ""}, "'host' must be an address"),
        ({"port": ["x" * 10_000_000] * 1000}, "'port' must be an integer, got ['xxxxxxxxxxxx"),
    ],
)
def test_bad_config_is_one_clear_sentence(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        build_config(raw)
    assert needle in str(ei.value) and "\n" not in str(ei.value)
    assert len(str(ei.value)) < 600  # a value is never expanded into the message


def test_cli_refuses_bad_config_with_exit_2(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("upstreams:\n  - name: a\n    url: http://127.0.0.1:1\n    modles: [x]\n")
    res = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert res.exit_code == 2
    assert "unknown config key 'upstreams[0].modles'" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["serve", "--config", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "cannot read config file" in res.output
    p.write_text("a: [1,\n")
    res = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert res.exit_code == 2 and "not valid YAML" in res.output


def test_cli_flags_override_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("port: 9000\ninject_usage: true\n")
    cfg = load_config(p, port=9100, inject_usage=False, upstream_url="http://127.0.0.1:1234")
    assert cfg.port == 9100 and not cfg.inject_usage and cfg.upstreams[0].url == "http://127.0.0.1:1234"
