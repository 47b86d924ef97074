"""The first hour of a new user: every mistake answered in one line with the documented
exit code (driven through the real CLI in a subprocess), `/v1` on a URL handled the same
way everywhere, Ctrl-C, and one vocabulary across commands (checked against each
command's click parameters and the table in docs/CLI.md)."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import orjson
import pytest

from mlxproxy.cli import main
from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim
from mlxproxy.vocabulary import DEPRECATED, EXIT_CODES, MEANINGS
from support import ENV, REPO, captured_chat, cli, closed_port, write_capture


def one_line_error(res: subprocess.CompletedProcess[str], code: int, *needles: str, ran: bool = False) -> str:
    """The command failed with `code` and said why in exactly one stderr line (warnings
    and notes may precede it), with no traceback. `ran`: the command started its run, so
    its progress lines come first and the error is the last line."""
    err = res.stderr
    assert res.returncode == code, (res.returncode, err[-1500:])
    assert "Traceback" not in err and "Aborted!" not in err, err[-1500:]
    lines = [
        ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("mlxproxy: warning:", "mlxproxy: note:"))
    ]
    if ran:
        lines = [ln for ln in lines if ln.startswith("mlxproxy")]
        assert lines and err.strip().splitlines()[-1] == lines[-1], err[-1500:]
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-request capture, its lines made by the capture format's own `capture_line`."""
    path = tmp_path_factory.mktemp("ux") / "capture.jsonl"
    messages = [{"role": "user", "content": "hi " * 30}]
    return write_capture(path, [captured_chat(f"c{i}", messages, started_at=1.0 + i, max_tokens=8) for i in range(2)])


# -- every mistake: one line, the documented exit code -------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:80800", "http://:abc", "ftp://127.0.0.1:8080", "127.0.0.1:8080", "http://127.0.0.1:8080?x=1"],
)
def test_serve_refuses_an_invalid_upstream_url_at_start(url: str) -> None:
    line = one_line_error(cli("serve", "--upstream", url, "--port", "0"), 2, "--upstream")
    assert url in line


def test_an_upstream_url_that_slipped_past_the_checks_gets_an_openai_shaped_error() -> None:
    """Config checks refuse a bad URL at start; a Config built in code skips them, and even
    then the client gets the OpenAI-shaped 502 with its request id, not a bare 500."""
    import httpx

    from mlxproxy.config import Config, UpstreamConfig
    from mlxproxy.proxy.app import create_app

    cfg = Config(upstreams=(UpstreamConfig("a", "http://127.0.0.1:80800"),), log_requests=False)
    with ServerThread(create_app(cfg)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
    assert r.status_code == 502 and r.headers.get("x-mlxproxy-request-id")
    err = r.json()["error"]
    assert err["code"] == "upstream_unreachable" and "invalid URL" in err["message"] and set(err) >= {"type", "param"}


def test_serve_refuses_an_invalid_upstream_url_in_the_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("upstreams:\n  - name: a\n    url: http://127.0.0.1:80800\n")
    one_line_error(
        cli("serve", "--config", str(cfg), "--port", "0"), 2, "config key 'upstreams[0].url'", "Port out of range"
    )


def test_flag_errors_name_the_flag_not_a_config_key() -> None:
    line = one_line_error(cli("serve", "--port", "99999"), 2, "--port")
    assert "config key" not in line
    one_line_error(cli("serve", "--timeout", "abc"), 2, "--timeout")


def test_a_taken_port_is_one_line_and_exit_1() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = str(s.getsockname()[1])
        one_line_error(cli("serve", "--port", port), 1, "cannot listen", port)
        one_line_error(cli("demo", "--port", port, "--repeat", "1"), 1, "cannot listen", port)
    finally:
        s.close()


def test_serve_refuses_a_capture_it_cannot_write(tmp_path: Path) -> None:
    one_line_error(
        cli("serve", "--port", "0", "--capture", str(tmp_path / "missing" / "c.jsonl")),
        2,
        "cannot write the capture file",
        "does not exist",
    )


def test_demo_refuses_a_folder_it_cannot_write(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a folder should be: mkdir fails even for root
    one_line_error(cli("demo", "--dir", str(blocker / "out"), "--repeat", "1"), 2, "cannot write to --dir")


@pytest.mark.parametrize("target", ["http://127.0.0.1:80800", "http://:abc", "a=ftp://x"])
def test_replay_and_bench_refuse_an_invalid_target(capture: Path, target: str) -> None:
    one_line_error(cli("replay", str(capture), "--target", target), 2, "--target")
    one_line_error(cli("bench", "--target", target), 2, "--target")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--batch", "2", "--concurrency", "3"], "give one"),
        (["--mode", "sequential", "--speed", "2"], "--speed only applies"),
        (["--mode", "sequential", "--batch", "2"], "conflicts"),
        (["--batch", "1"], "--batch"),
        (["--timeout", "other=5"], "no target named"),
    ],
)
def test_replay_refuses_conflicting_flags_with_the_reason(capture: Path, args: list[str], needle: str) -> None:
    one_line_error(cli("replay", str(capture), "--target", "a=http://127.0.0.1:9", *args), 2, needle)


def test_bench_flag_errors(tmp_path: Path) -> None:
    one_line_error(cli("bench", "--target", "a=http://127.0.0.1:9", "--batch", "1"), 2, "--batch")
    one_line_error(cli("bench", "--target", "a=http://127.0.0.1:9", "--prompt-tokens", "1,x"), 2, "comma-separated")
    one_line_error(cli("bench", "--target", "a=http://127.0.0.1:9", "--target", "a=http://127.0.0.1:8"), 2, "unique")
    one_line_error(
        cli("bench", "--target", "a=http://127.0.0.1:9", "--json", str(tmp_path / "no" / "r.json")), 2, "does not exist"
    )


def test_replay_and_bench_exit_1_when_every_request_failed(capture: Path) -> None:
    with ServerThread(create_sim("healthy", speed=20, faults="http-error=500")) as sim:
        one_line_error(
            cli("replay", str(capture), "--target", sim.url, "--mode", "sequential"),
            1,
            "every request failed",
            "http_error 2",
            ran=True,
        )
    dead = f"http://127.0.0.1:{closed_port()}"
    line = one_line_error(
        cli("bench", "--target", f"dead={dead}", "--prompt-tokens", "100", "--repeat", "1"),
        1,
        "every target failed",
        f"{dead} is unreachable: ConnectionRefusedError",
        ran=True,
    )
    assert line.count(dead) == 1 and "cannot reach" not in line  # said once


def test_replay_checks_the_target_before_its_schedule_like_bench() -> None:
    """builtin:agent's recorded schedule takes ~28 s; a dead target is one line at once."""
    dead = f"http://127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    res = cli("replay", "builtin:agent", "--target", dead)
    took = time.monotonic() - t0
    line = one_line_error(res, 1, f"{dead} is unreachable", "Connection refused")
    assert res.stdout == "" and "schedule lag" not in res.stderr and "replaying" not in res.stderr
    assert took < 15, took  # the schedule alone is ~28 s
    assert line.endswith("Connection refused"), line  # whole words, nothing cut


def test_report_on_a_capture_says_replay_it(capture: Path, tmp_path: Path) -> None:
    one_line_error(cli("report", str(capture)), 2, "is a capture file", "mlxproxy replay")
    one_line_error(cli("report", str(tmp_path / "missing.json")), 2, "cannot read result file")


def test_one_bad_capture_line_is_named_and_can_be_skipped(capture: Path, tmp_path: Path) -> None:
    lines = capture.read_bytes().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(lines[0] + b"\n{not json\n" + lines[1] + b"\n")
    one_line_error(cli("replay", str(bad), "--target", "http://127.0.0.1:9"), 2, "bad.jsonl:2", "--skip-bad-lines")
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        res = cli("replay", str(bad), "--target", sim.url, "--mode", "sequential", "--skip-bad-lines")
    assert res.returncode == 0, res.stderr[-1500:]
    assert "skipped 1 unreadable line(s)" in res.stderr and "ok/req" in res.stdout and "2/2" in res.stdout


# -- /v1 on a URL: stripped everywhere, with one line saying so -------------------------------


def test_v1_on_a_target_is_dropped_with_one_note(capture: Path, tmp_path: Path) -> None:
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        res = cli(
            "replay",
            str(capture),
            "--target",
            sim.url + "/v1/",
            "--mode",
            "sequential",
            "--json",
            str(tmp_path / "r.json"),
        )
        assert res.returncode == 0, res.stderr[-1500:]
        notes = [ln for ln in res.stderr.splitlines() if "ends in /v1" in ln]
        assert len(notes) == 1 and sim.url in notes[0]
        doc = orjson.loads((tmp_path / "r.json").read_bytes())
        assert all(r["outcome"] == "ok" for g in doc["groups"] for r in g["records"])
        res = cli("bench", "--target", f"s={sim.url}/v1", "--prompt-tokens", "50", "--repeat", "1", "--max-tokens", "4")
        assert res.returncode == 0, res.stderr[-1500:]
        assert sum("ends in /v1" in ln for ln in res.stderr.splitlines()) == 1


@contextmanager
def serve_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """`mlxproxy serve` in a subprocess; yields it, its URL and its stderr lines so far."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxproxy", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    lines: list[str] = []
    got_url = threading.Event()
    url: list[str] = []

    def reader() -> None:
        assert proc.stderr is not None
        for ln in proc.stderr:
            lines.append(ln.rstrip("\n"))
            m = re.search(r"listening on (http://[\d.]+:\d+)/v1", ln)
            if m:
                url.append(m.group(1))
                got_url.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        assert got_url.wait(60), lines
        yield proc, url[0], lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        t.join(10)


def test_serve_drops_v1_forwards_and_stops_quietly_on_ctrl_c() -> None:
    import httpx

    with ServerThread(create_sim("healthy", speed=20)) as sim:
        with serve_process("--upstream", sim.url + "/v1") as (proc, url, lines):
            assert sum("ends in /v1" in ln for ln in lines) == 1, lines
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
    text = "\n".join(lines)
    assert "Traceback" not in text and "Aborted" not in text and lines[-1] == "mlxproxy: stopped", lines[-5:]


class Counting:
    """ASGI wrapper counting finished generation responses (so a test knows a request was
    measured). Only POSTs count: replay and bench first reach the target with `GET /v1/models`,
    which is never a measured request."""

    def __init__(self, app: Any) -> None:
        self.app, self.done, self.started = app, 0, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        post = scope["type"] == "http" and scope["method"] == "POST"
        self.started += post  # a POST has arrived (its answer may take a while)
        await self.app(scope, receive, send)
        self.done += post


#: `python -m mlxproxy` with Ctrl-C delivered as in a terminal. A test run started in the
#: background (`cmd &` in a script, some CI steps) has SIGINT ignored, children inherit that, and
#: asyncio.Runner then leaves SIGINT alone: the command would never see the test's Ctrl-C.
MLXPROXY_WITH_CTRL_C = [
    sys.executable,
    "-c",
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'mlxproxy'; runpy.run_module('mlxproxy', run_name='__main__', alter_sys=True)",
]


def test_ctrl_c_during_replay_keeps_what_was_measured(capture: Path, tmp_path: Path) -> None:
    app = Counting(create_sim("healthy", speed=1.0, decode_tps=20.0))  # 8 tokens: ~0.4 s a request
    out = tmp_path / "partial.json"
    with ServerThread(app) as sim:
        proc = subprocess.Popen(
            [
                *MLXPROXY_WITH_CTRL_C,
                "replay",
                str(capture),
                "--target",
                sim.url,
                "--mode",
                "sequential",
                "--repeat",
                "50",
                "--json",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        deadline = time.monotonic() + 60
        # the server counts a response when it has sent it, the client records it a moment
        # later; in sequential mode a third request means the second one was recorded
        while app.done < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)  # waiting for progress, not measuring
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-1500:]
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("mlxproxy: interrupted:")
    doc = orjson.loads(out.read_bytes())
    recs = [r for g in doc["groups"] for r in g["records"]]
    assert 2 <= len(recs) < 100 and "interrupted" in doc["groups"][-1]["mode"] and "ok/req" in stdout


def test_ctrl_c_during_bench_keeps_what_was_measured(tmp_path: Path) -> None:
    app = Counting(create_sim("healthy", speed=1.0, decode_tps=20.0))
    out = tmp_path / "partial.json"
    with ServerThread(app) as sim:
        proc = subprocess.Popen(
            [
                *MLXPROXY_WITH_CTRL_C,
                "bench",
                "--target",
                f"s={sim.url}",
                "--prompt-tokens",
                "50,100",
                "--repeat",
                "20",
                "--max-tokens",
                "8",
                "--json",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        deadline = time.monotonic() + 60
        # 2 probes + /v1/models + 2 singles, and one more so the second single has been recorded
        while app.done < 6 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)  # waiting for progress, not measuring
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-1500:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("mlxproxy: interrupted:")
    doc = orjson.loads(out.read_bytes())
    singles = [r for g in doc["groups"] if g["name"] == "single" for r in g["records"]]
    assert 2 <= len(singles) < 40 and "interrupted" in doc["targets"][0]["error"] and "Verdicts:" in stdout
    m = re.search(r"interrupted after (\d+) measured (requests?)", doc["targets"][0]["error"])
    assert m and m.group(2) == ("request" if m.group(1) == "1" else "requests"), doc["targets"][0]["error"]


def _ctrl_c_when(app: Counting, args: list[str], posts: int) -> tuple[subprocess.Popen[str], str, str, int]:
    """Run `mlxproxy args`, Ctrl-C it once the server has answered `posts` POSTs: the process,
    its stdout and stderr, and the POSTs answered when the signal was sent."""
    proc = subprocess.Popen(
        [*MLXPROXY_WITH_CTRL_C, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    deadline = time.monotonic() + 60
    while app.done < posts and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)  # waiting for progress, not measuring
    seen = app.done
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return proc, stdout, stderr, seen


def test_ctrl_c_during_replay_with_two_workers_keeps_what_they_measured(capture: Path, tmp_path: Path) -> None:
    app = Counting(create_sim("healthy", speed=1.0, decode_tps=20.0))  # 8 tokens: ~0.4 s a request
    out = tmp_path / "partial.json"
    with ServerThread(app) as sim:
        args = ["replay", str(capture), "--target", sim.url, "--concurrency", "2", "--repeat", "50"]
        proc, stdout, stderr, seen = _ctrl_c_when(app, [*args, "--workers", "2", "--json", str(out)], 6)
    assert proc.returncode == 130, stderr[-1500:]
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("mlxproxy: interrupted:")
    assert "kept from 2 load workers" in stderr, stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    recs = [r for g in doc["groups"] for r in g["records"]]
    # one stream a worker, one request at a time: of the POSTs answered before the signal,
    # only each stream's last may not have been recorded yet
    assert seen - 2 <= len(recs) < 100 and "interrupted" in doc["groups"][-1]["mode"] and "ok/req" in stdout
    assert len({r["id"] for r in recs}) == len(recs)


def test_ctrl_c_during_bench_with_two_workers_keeps_what_they_measured(tmp_path: Path) -> None:
    app = Counting(create_sim("healthy", speed=1.0, decode_tps=20.0))
    out = tmp_path / "partial.json"
    with ServerThread(app) as sim:
        args = ["bench", "--target", f"s={sim.url}", "--prompt-tokens", "50", "--repeat", "1", "--max-tokens", "8"]
        # 2 probes, 1 single, then the sweep step of 2 streams (20 requests) on 2 workers
        args += ["--concurrency", "2", "--workers", "2", "--json", str(out)]
        proc, stdout, stderr, seen = _ctrl_c_when(app, args, 3 + 6)
    assert proc.returncode == 130, stderr[-1500:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("mlxproxy: interrupted:")
    assert "kept from 2 load workers" in stderr, stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    singles = [r for g in doc["groups"] if g["name"] == "single" for r in g["records"]]
    assert len(singles) == 1 and "Verdicts:" in stdout
    m = re.search(r"interrupted after (\d+) measured requests?", doc["targets"][0]["error"])
    # the single and the step's records (each stream's last answered POST may not be recorded yet)
    assert m and 1 + (seen - 3 - 2) <= int(m.group(1)) < 1 + 20, doc["targets"][0]["error"]


# -- report renders what was measured --------------------------------------------------------


def test_report_renders_the_runs_own_view_with_distinct_labels(tmp_path: Path) -> None:
    import csv

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with ServerThread(create_sim("healthy", speed=20, batch_penalty=0.02)) as sim:
        runs = [
            cli(
                "bench",
                "--target",
                f"s={sim.url}",
                "--prompt-tokens",
                "50,200",
                "--repeat",
                "2",
                "--max-tokens",
                "8",
                "--json",
                str(tmp_path / d / "bench.json"),
            )
            for d in ("a", "b")
        ]
    for res in runs:
        assert res.returncode == 0, res.stderr[-1500:]
        assert "Verdicts:" in res.stdout and "TTFT: time to first token" in res.stdout  # a legend under the table
        assert max(len(ln) for ln in res.stdout.splitlines()) <= 100
    again = cli(
        "report",
        str(tmp_path / "a" / "bench.json"),
        "--csv",
        str(tmp_path / "r.csv"),
        "--markdown",
        str(tmp_path / "r.md"),
        "--plot",
        str(tmp_path / "r.svg"),
    )
    assert again.returncode == 0, again.stderr[-1500:]
    assert again.stdout == runs[0].stdout  # the same view as the run that wrote it
    doc = orjson.loads((tmp_path / "a" / "bench.json").read_bytes())
    ids = {r["id"] for g in doc["groups"] for r in g["records"]}
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # one row per request: 2 sizes x2, one wave of 2 x2, one request alone around each wave (the baseline)
    assert len(rows) == len(ids) == 2 * 2 + 2 * 2 + (2 + 1)
    assert (tmp_path / "r.md").read_text().count("| s |") >= 2 and (tmp_path / "r.svg").read_text().startswith("<svg")
    both = cli("report", str(tmp_path / "a" / "bench.json"), str(tmp_path / "b" / "bench.json"))
    assert both.returncode == 0 and "a/bench.json:s" in both.stdout and "b/bench.json:s" in both.stdout


# -- one vocabulary ------------------------------------------------------------------------


def _kind(p: click.Parameter) -> str:
    if isinstance(p, click.Option) and p.is_flag:
        return "flag"
    name = p.type.name
    return {"integer range": "integer", "float range": "float"}.get(name, name)


def command_options() -> dict[str, dict[str, click.Option]]:
    """option spelling -> {command: its click Option}, hidden (deprecated) ones left out."""
    out: dict[str, dict[str, click.Option]] = {}
    for cname, cmd in main.commands.items():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.hidden:
                continue
            for spelling in p.opts:
                if spelling.startswith("--") and spelling != "--help":
                    out.setdefault(spelling, {})[cname] = p
    return out


def test_every_shared_option_has_one_meaning() -> None:
    shared = {o: cmds for o, cmds in command_options().items() if len(cmds) > 1}
    assert {"--target", "--timeout", "--batch", "--repeat", "--port", "--nonce", "--json"} <= set(shared)
    for opt, cmds in shared.items():
        assert opt in MEANINGS, f"{opt} is used by {sorted(cmds)} but has no entry in mlxproxy/vocabulary.py"
        kinds = {c: _kind(p) for c, p in cmds.items()}
        assert len(set(kinds.values())) == 1, (opt, kinds)
        for c, p in cmds.items():
            assert (p.help or "").startswith(MEANINGS[opt]), (opt, c, p.help)


def test_old_spellings_still_work_with_a_deprecation_line(capture: Path) -> None:
    for command, opt in DEPRECATED:
        p = next(p for p in main.commands[command].params if opt in getattr(p, "opts", ()))
        assert p.hidden, (command, opt)
    res = cli("sim", "--max-tokens", "7", "--dry-run")
    assert res.returncode == 0 and '"max_output_tokens": 7' in res.stdout
    assert "sim --max-tokens is deprecated" in res.stderr and "--max-output-tokens" in res.stderr
    res = cli("replay", str(capture), "--target", "http://127.0.0.1:80800", "--name", "x")
    assert "replay --name is deprecated" in res.stderr


def cli_doc_table(marker: str) -> list[list[str]]:
    """A table of docs/CLI.md (it was the README's until the README became a front page)."""
    text = (REPO / "docs" / "CLI.md").read_text(encoding="utf-8")
    block = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in block.splitlines() if ln.startswith("|")]
    return rows[2:]  # header and separator


def test_the_cli_doc_vocabulary_table_matches_the_commands() -> None:
    opts = command_options()
    rows = {r[0].strip("`"): r for r in cli_doc_table("vocabulary")}
    assert set(rows) == set(MEANINGS), set(rows) ^ set(MEANINGS)
    for opt, (_, commands, meaning) in rows.items():
        assert meaning == MEANINGS[opt], opt
        assert sorted(c.strip() for c in commands.split(",")) == sorted(opts.get(opt, {})), (opt, commands)


def test_the_cli_doc_exit_codes_match() -> None:
    rows = cli_doc_table("exit-codes")
    assert {int(r[0]) for r in rows} == set(EXIT_CODES)


def test_no_machine_specific_paths_in_the_repository() -> None:
    """Paths of one machine (a developer's home, this project's build hosts) make the
    repository work only there. Recorded client traffic in tests/fixtures/ is left as sent."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"(?<![\w.])(/Users/\w|/home/\w|/work/\w|/opt/homebrew)")
    found = []
    for f in files:
        if f.startswith("tests/fixtures/") or f.endswith((".png", ".sse")) or f == "tests/e2e/test_cli_ux.py":
            continue
        try:
            text = (REPO / f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found += [f"{f}:{i + 1}: {ln.strip()[:80]}" for i, ln in enumerate(text.splitlines()) if pattern.search(ln)]
    assert not found, found


# -- the first hour, round two -----------------------------------------------------------------


def test_bare_mlxproxy_prints_the_help_on_several_lines() -> None:
    res = cli()
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith("Usage: mlxproxy") and len(out) > 10, out
    assert any(ln.strip().startswith("serve") for ln in out) and res.stderr == ""


def test_serve_given_an_endpoints_whole_url_cuts_it_at_v1_with_one_note() -> None:
    import httpx

    with ServerThread(create_sim("healthy", speed=20)) as sim:
        with serve_process("--upstream", sim.url + "/v1/chat/completions") as (proc, url, lines):
            notes = [ln for ln in lines if "ends in /v1/chat/completions" in ln]
            assert len(notes) == 1 and f"using {sim.url} " in notes[0], lines
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4  # not a 404


def test_replay_of_a_result_file_or_an_empty_capture_says_what_to_run(tmp_path: Path) -> None:
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        result = tmp_path / "result.json"
        res = cli("bench", "--target", f"s={sim.url}", "--prompt-tokens", "50", "--repeat", "1", "--json", str(result))
        assert res.returncode == 0, res.stderr[-1500:]
        line = one_line_error(cli("replay", str(result), "--target", sim.url), 2, "is a result file", "mlxproxy report")
        assert "not a JSON line" not in line and "--skip-bad-lines" not in line
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        line = one_line_error(cli("replay", str(empty), "--target", sim.url), 2, "holds none", "serve --capture")
        assert "filters" not in line


def ctrl_c_after(args: list[str], ready: Any, timeout_s: float = 60) -> tuple[int, str, str]:
    """Run `mlxproxy ARGS`, press Ctrl-C once `ready()` holds; (exit code, stdout, stderr)."""
    proc = subprocess.Popen(
        [*MLXPROXY_WITH_CTRL_C, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)  # waiting for progress, not measuring
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stdout, stderr


def test_ctrl_c_before_any_replay_result_prints_no_empty_table(capture: Path) -> None:
    app = Counting(create_sim("healthy", speed=1.0, decode_tps=2.0))  # 8 tokens: 4 s a request
    with ServerThread(app) as sim:
        code, stdout, stderr = ctrl_c_after(
            ["replay", str(capture), "--target", sim.url, "--mode", "sequential"], lambda: app.started >= 1
        )  # the first request has gone out and takes 4 s: nothing is measured yet
    assert code == 130 and "Traceback" not in stderr, stderr[-1500:]
    assert stdout == "", stdout  # no legend under a table that is not there
    assert stderr.strip().splitlines()[-1] == "mlxproxy: interrupted before any request finished"


class Held:
    """ASGI wrapper answering the first `free` POSTs and holding every later one until `released`
    (so a test can Ctrl-C a run after exactly `free` requests were answered). `started` counts
    the POSTs that arrived; GETs (`/v1/models`) pass."""

    def __init__(self, app: Any, free: int) -> None:
        self.app, self.free, self.started, self.released = app, free, 0, False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.started += 1
            while self.started > self.free and not self.released:
                await asyncio.sleep(0.05)  # held until the test lets go, not measuring
        await self.app(scope, receive, send)


def test_ctrl_c_after_one_measured_request_says_request_not_requests(capture: Path) -> None:
    """A run cut after exactly one answered request counts it in the singular: bench's verdict
    and result file say `interrupted after 1 measured request`, replay's last line
    `1 finished request printed` (the issue saw "1 measured requests")."""
    app = Held(create_sim("healthy", speed=20), free=3)  # bench: 2 probe requests, then 1 measured
    with ServerThread(app) as sim:
        try:
            code, stdout, stderr = ctrl_c_after(
                ["bench", "--target", f"s={sim.url}", "--prompt-tokens", "50", "--repeat", "1", "--max-tokens", "8"],
                lambda: app.started > 3,  # the one measured request was answered and the next is held
            )
        finally:
            app.released = True
    assert code == 130 and "Traceback" not in stderr, stderr[-1500:]
    out = stdout.splitlines()
    assert out[out.index("Verdicts:") + 1] == "s  interrupted after 1 measured request", stdout[-1500:]
    app = Held(create_sim("healthy", speed=20), free=1)  # replay: its first request, then one held
    with ServerThread(app) as sim:
        try:
            code, stdout, stderr = ctrl_c_after(
                ["replay", str(capture), "--target", sim.url, "--mode", "sequential"], lambda: app.started > 1
            )
        finally:
            app.released = True
    assert code == 130 and "Traceback" not in stderr, stderr[-1500:]
    assert "replaying 2 requests x1 from" in stderr, stderr[-1500:]
    assert stderr.strip().splitlines()[-1] == "mlxproxy: interrupted: 1 finished request printed", stderr[-1500:]


def test_ctrl_c_during_demo_names_the_capture_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cap = out / "capture.jsonl"

    def some_captured() -> bool:
        return cap.exists() and len(cap.read_bytes().splitlines()) >= 3

    code, _, stderr = ctrl_c_after(["demo", "--repeat", "1", "--dir", str(out)], some_captured, 120)
    assert code == 130 and "Traceback" not in stderr, stderr[-1500:]
    last = stderr.strip().splitlines()[-1]
    n = len(cap.read_bytes().splitlines())
    assert "nothing written" not in last and f"{cap} holds the {n} requests forwarded so far" in last, last
    assert last.startswith("mlxproxy: interrupted before the benchmark finished: no results written")


def _shape(line: str) -> list[str]:
    """A log line with its values blanked: the logger, the fields and their order remain."""
    line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "TIME ", line)
    line = re.sub(r"\b[0-9a-f]{16}\b", "ID", line)
    return re.sub(r"=[^ ]+", "=V", line).split()[:2] + re.findall(r"\S+=", line)


def test_the_usage_docs_example_log_line_is_what_serve_prints() -> None:
    import httpx

    text = (REPO / "docs" / "USAGE.md").read_text(encoding="utf-8")
    example = text.split("Each finished request logs one line")[1].split("```text\n")[1].split("\n")[0]
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        with serve_process("--upstream", sim.url) as (proc, url, lines):
            body = {"model": "qwen", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
                r.read()
            deadline = time.monotonic() + 10
            while not any(" chat_completions " in ln for ln in lines) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting for the log line, not measuring
    real = next(ln for ln in lines if " chat_completions " in ln)
    assert _shape(example) == _shape(real), (example, real)
    assert example.split(" ")[2:4] == real.split(" ")[2:4] == ["INFO", "mlxproxy:"]


def test_sim_on_a_taken_port_says_only_that() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        port = str(s.getsockname()[1])
        res = cli("sim", "--port", port)
    finally:
        s.close()
    assert res.stdout == "", res.stdout[:300]  # no knobs or truth lines for a server that never ran
    assert (
        res.returncode == 1
        and len(res.stderr.strip().splitlines()) == 1
        and res.stderr.startswith(f"mlxproxy sim: cannot listen on 127.0.0.1:{port}: ")
    )


#: error texts as the load generator and the proxy meet them, each longer than some of the limits
LONG_ERRORS = [
    "cannot reach http://127.0.0.1:18999: ClientConnectorError: Cannot connect to host 127.0.0.1:18999 "
    "ssl:default [Connect call failed ('127.0.0.1', 18999)]",
    "upstream 'gone' at http://127.0.0.1:18999 is unreachable: ConnectionRefusedError: [Errno 111] Connection refused",
    "HTTP 500:" + " the model runner failed at token 12345 of 67890 after 3.25 s, retry later;" * 6,
    "ClientConnectorError: Cannot connect to host a-long-host-name.internal.example:18999 ssl:default "
    "[Name or service not known]",
]


def test_a_long_error_is_cut_after_a_whole_word_never_inside_a_number() -> None:
    """`clip`, which every one-line error goes through, at every limit from 30 characters: the
    text kept is the error's start and ends where a word, a number, an address or a port ends
    (the issue saw `Connection refu` and port 18999 shown as `1899`)."""
    from mlxproxy.core.text import clip

    def in_token(c: str) -> bool:  # a character of a word, a number or a dotted address
        return c.isalnum() or c in "._-"

    for text in LONG_ERRORS:
        for limit in range(30, len(text) + 2):
            out = clip(text, limit)
            assert len(out) <= limit, (limit, out)
            if len(text) <= limit:
                assert out == text
                continue
            kept = out.removesuffix("…")
            assert out.endswith("…") and kept and text.startswith(kept), (limit, out)
            assert not (in_token(kept[-1]) and in_token(text[len(kept)])), (limit, out, text[len(kept) :][:20])


@pytest.mark.parametrize(
    "pauses, evidence_starts, cyclic",
    [
        ((20, 21, 22), "3 gaps over", None),
        ((20,), "1 gap over", None),
        ((5, 15, 25, 35), "4 gaps over", "; cyclic: every ~10 events"),  # what cyclic is
    ],
    ids=["three-back-to-back-gaps", "one-gap", "four-stalls-every-10"],
)
def test_a_stall_is_called_cyclic_only_when_it_recurs(
    tmp_path: Path, pauses: tuple[int, ...], evidence_starts: str, cyclic: str | None
) -> None:
    """A server that pauses once, with a token or two in the middle of the pause (three long
    gaps in a row), was reported as `cyclic: every ~1 events`; a pause of one long gap is
    `1 gap`, not cyclic; pauses every 10 tokens are. The replay of the one-request capture
    says `replaying 1 request`."""
    from fakeupstream import Conn, FakeUpstream, Req

    def event(text: str) -> bytes:
        chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def handler(req: Req, conn: Conn) -> None:
        if req.method == "GET":
            await conn.head(404, [("content-length", "0")])
            return
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        for i in range(40):
            if i in pauses:  # a long gap before each of these tokens
                await asyncio.sleep(1.2)  # the server's script, not a measurement
            else:
                await asyncio.sleep(0.01)
            await conn.chunk(event(f" t{i}"))
        end = {
            "id": "x",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
        }
        await conn.chunk(b"data: " + orjson.dumps(end) + b"\n\n" + b"data: [DONE]\n\n")
        await conn.end_chunked()

    cap = write_capture(tmp_path / "c.jsonl", [captured_chat("c0", [{"role": "user", "content": "hi"}], max_tokens=40)])
    with FakeUpstream(handler) as up:
        res = cli("replay", str(cap), "--target", up.url, "--mode", "sequential", "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-1500:]
    assert f"replaying 1 request x1 from {cap} " in res.stderr, res.stderr[-1500:]  # not "1 requests"
    (rec,) = [r for g in orjson.loads((tmp_path / "r.json").read_bytes())["groups"] for r in g["records"]]
    evidence = rec["anomaly_evidence"]["stall"]
    assert evidence.startswith(evidence_starts), evidence
    assert evidence.endswith(cyclic) if cyclic else "cyclic" not in evidence, evidence


def test_a_synthetic_sweep_plot_leaves_out_empty_charts_and_labels_its_axes(tmp_path: Path) -> None:
    """`bench --sweep` at one prompt size (the README's synthetic sweep): no batching waves, so
    their charts are left out rather than drawn as "no data", and the one prompt size is a tick."""
    svg = tmp_path / "capacity.svg"
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        res = cli(
            "bench", "--target", sim.url, "--sweep", "--prompt-tokens", "400", "--repeat", "1",
            "--max-tokens", "8", "--concurrency", "1,2", "--plot", str(svg),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    text = svg.read_text()
    assert "no data" not in text and "Batching" not in text and "released together" not in text
    assert "TTFT by prompt size" in text and "TTFT by concurrency" in text
    assert text.count('text-anchor="middle" font-size="12">400</text>') == 2  # TTFT and prefill by prompt size


def test_a_long_target_name_fits_the_plots_legend_whole(tmp_path: Path) -> None:
    """A legend entry longer than the legend's room is squeezed to fit, never cut off at the
    chart's right edge (the issue saw `(no data` cut so), measured where it is drawn: in Chromium."""
    from browser import Chromium, require_chromium

    require_chromium()
    name = "mlx_lm.server-Qwen3-30B-A3B-Instruct-4bit"  # ~280 px of 12 px text; the legend has 144
    svg = tmp_path / "plot.svg"
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        res = cli(
            "bench", "--target", f"{name}={sim.url}", "--prompt-tokens", "100,400", "--repeat", "1",
            "--max-tokens", "8", "--batch", "2", "--plot", str(svg),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    with Chromium() as chromium:
        page = chromium.page(offline=True)
        page.goto(svg.as_uri())
        width, titles, legend = page.eval(
            "[document.documentElement.width.baseVal.value,"
            " document.querySelectorAll('text[font-weight=bold]').length,"
            f" [...document.querySelectorAll('text')].filter(t => t.textContent.startsWith({name[:10]!r}))"
            "   .map(t => { const b = t.getBBox(); return [t.textContent, b.x, b.x + b.width]; })]"
        )
        assert page.errors == [], page.errors
    assert titles >= 4 and len(legend) == titles, (titles, legend)  # one entry on every chart
    for text, left, right in legend:
        assert text == name and left > width / 2 and right <= width, (text, left, right, width)
