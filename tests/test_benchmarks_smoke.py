"""The benchmark harness imports and answers --help. No timing here: timing never belongs
in unit tests (benchmarks/run.py measures, the README records)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_harness_modules_import():
    run = _load("run")
    loadgen = _load("loadgen")
    upstream = _load("upstream")
    floor = _load("floor")
    assert callable(run.main) and callable(loadgen.run_job) and callable(upstream.cli) and callable(floor.Floor)
    assert run.pct([1.0, 2.0, 3.0], 50) == 2.0


def test_litellm_is_an_option_or_env_with_a_stated_skip(tmp_path: Path) -> None:
    run = _load("run")
    exe = tmp_path / "litellm"
    exe.write_text("")
    assert run.choose_litellm(None, False, str(exe)) == (str(exe), "")
    assert run.choose_litellm(str(exe), True, "") == (str(exe), "")  # given explicitly: kept, also with --quick
    path, why = run.choose_litellm(None, False, "")
    assert path == "" and "MLXPROXY_LITELLM" in why and "--litellm" in why
    path, why = run.choose_litellm(None, False, str(tmp_path / "gone"))
    assert path == "" and "not found" in why
    assert (
        run.choose_litellm(None, True, str(exe))[0] == "" and "--quick" in run.choose_litellm(None, True, str(exe))[1]
    )
    assert run.choose_litellm("", False, str(exe)) == ("", "left out (--litellm '')")


def test_run_refuses_a_missing_litellm_before_starting_anything(tmp_path: Path) -> None:
    missing = tmp_path / "no-litellm"
    r = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--litellm", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.strip() == f"error: --litellm: no such file: {missing}"


def test_run_help():
    r = subprocess.run([sys.executable, str(BENCH / "run.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout


def test_upstream_and_meter_bench_help():
    for script in (
        "upstream.py",
        "bench_meter.py",
        "generator.py",
        "instructions.py",
        "generator_instructions.py",
        "soak_memory.py",
    ):
        r = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", ["instructions.py", "generator_instructions.py"])
def test_instructions_refuses_a_folder_without_the_package(tmp_path, script):
    r = subprocess.run([sys.executable, str(BENCH / script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and ("holds no mlxproxy/ package" in r.stderr or "valgrind" in r.stderr)


def test_pooled_percentiles_pool_every_round_and_take_the_median_over_files(tmp_path: Path) -> None:
    pooled = _load("pooled")

    def one(path: Path, shift: float) -> str:
        rounds = {  # two rounds each: 1..10 ms and 11..20 ms pooled to 1..20 ms
            "direct": [{"ttft": [0.001] * 10}, {"ttft": [0.001] * 10}],
            "a": [
                {"ttft": [(i + shift) / 1e3 for i in range(1, 11)]},
                {"ttft": [(i + shift) / 1e3 for i in range(11, 21)]},
            ],
        }
        path.write_text(json.dumps({"scenarios": {"ttft": rounds}}))
        return str(path)

    files = [one(tmp_path / "1.json", 0.0), one(tmp_path / "2.json", 1.0), one(tmp_path / "3.json", 100.0)]
    a = pooled.pooled(files[0], "ttft")["a"]
    assert (a["p10"], a["p50"], a["p90"], a["n"]) == pytest.approx((2.9, 10.5, 18.1, 20.0))  # run.py's pct
    assert a["added mean"] == pytest.approx(10.5 - 1.0)
    assert pooled.pooled(files[0], "seq") == {}  # a scenario the run did not have
    out = subprocess.run([sys.executable, str(BENCH / "pooled.py"), *files], capture_output=True, text=True, check=True)
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["a"])
    assert float(row[2]) == 11.5  # p50 over the files: 10.5, 11.5 and 110.5 -> 11.5, the outlier file ignored
