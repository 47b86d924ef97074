"""``mlxproxy bench`` against every live seed server at once, run several times.

    python -m tests.integration.bench_live [--runs 3] [--max-tokens 160] [--repeat 3] [--json-dir DIR]

Starts vllm-mlx (simple and ``--continuous-batching``), mlx-openai-server, Rapid-MLX, mlx-vlm
(``live_servers.py``) and mlx_lm.server (``tinymodel.mlx_lm_server``), all serving the rigged
model (``rigged.py``) built so that any plain prompt, such as bench's filler text, gets the
endless answer: every stream runs to ``max_tokens``, long enough for two to overlap. Then runs ONE
``mlxproxy bench`` with a ``--target`` per server, ``--runs`` times, and prints each server's
batching verdict per run, its overlap and speedup figures, and whether the class agreed over the
runs and with the overlap (``wave_class`` applied to the median figures).

A server whose venv is missing or that does not start is left out with the reason printed.
Only loopback is contacted. The integration test ``test_bench_live.py`` uses the same helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlxproxy.load.output.bench_verdict import BATCH_CLASSES, OVERLAP_BATCHING, OVERLAP_SERIAL

from .live_servers import live_server, unavailable_reason
from .tinymodel import mlx_lm_server

#: every server the bench runs against, in the order of the table
SERVERS = ("vllm-mlx", "vllm-mlx-cb", "mlx-openai-server", "mlx-openai-server-1.8", "rapid-mlx", "mlx-vlm", "mlx-lm")


def build_loop_model(dir: Path) -> Path:
    """The rigged model whose answer to any prompt without ``think``/``forever``/tools is the
    endless loop instead of the 16 words (bench's filler prompt then streams to max_tokens)."""
    from .rigged import build_rigged_model

    rig = build_rigged_model(dir)
    cfg_path = rig.path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    words = "{%- else %}<|rig_words|>{% endif %}"
    if words not in cfg["chat_template"]:
        raise RuntimeError("rigged chat template changed: cannot make the loop build")
    cfg["chat_template"] = cfg["chat_template"].replace(words, "{%- else %}<|rig_loop|>{% endif %}")
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return rig.path


@contextlib.contextmanager
def all_servers(
    model: Path, logs: Path, names: tuple[str, ...] = SERVERS
) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """Start every server of ``names`` that can run here; yield ({name: url}, {name: why not})."""
    urls: dict[str, str] = {}
    missing: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            if name == "mlx-lm":
                try:
                    urls[name] = stack.enter_context(
                        mlx_lm_server(model, max_tokens=4096, log_path=logs / f"{name}.log", startup_timeout=180.0)
                    )
                except RuntimeError as exc:
                    missing[name] = f"did not start: {str(exc)[:300]}"
                continue
            why = unavailable_reason(name)
            if why is not None:
                missing[name] = why
                continue
            try:
                urls[name] = stack.enter_context(live_server(name, model, log_path=logs / f"{name}.log")).url
            except RuntimeError as exc:
                missing[name] = f"did not start: {str(exc)[:300]}"
        yield urls, missing


def run_bench(
    urls: dict[str, str], json_path: Path, *, max_tokens: int, repeat: int, prompt_tokens: int = 100
) -> tuple[list[str], dict[str, Any]]:
    """One ``mlxproxy bench`` over every url; (the argv, the JSON result document)."""
    argv = [sys.executable, "-m", "mlxproxy", "bench"]
    for name, url in urls.items():
        argv += ["--target", f"{name}={url}"]
    argv += [
        "--prompt-tokens",
        str(prompt_tokens),
        "--max-tokens",
        str(max_tokens),
        "--repeat",
        str(repeat),
        "--timeout",
        "300",
        "--json",
        str(json_path),
    ]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["NO_PROXY"] = "127.0.0.1,localhost"
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if not json_path.exists():
        raise RuntimeError(f"mlxproxy bench exited {proc.returncode} without a result:\n{proc.stderr[-3000:]}")
    return argv, json.loads(json_path.read_text())


def verdict_class(text: str) -> str:
    """The batching class a verdict line starts with (``inconclusive`` included)."""
    if text.startswith("inconclusive"):
        return "inconclusive"
    for c in sorted(BATCH_CLASSES, key=len, reverse=True):
        if text.startswith(c):
            return c
    if text.startswith("speedup") and "overlap not measurable" in text:
        return "overlap not measurable"
    return text.split(",")[0]


#: what the server does with two streams, whatever the machine's spare CPU makes of the gain:
#: "continuous batching", "batches, no gain" and the gain left open are all "generated together"
TOGETHER = "generated together"


def behaviour(cls: str, text: str) -> str:
    """The server's part of a verdict class: the gain folded into "generated together"."""
    if cls in ("continuous batching", "batches, no gain") or text.startswith(
        "inconclusive: the streams are generated together"
    ):
        return TOGETHER
    return cls


def double_summary(doc: dict[str, Any], target: str) -> dict[str, Any] | None:
    return next((g["summary"] for g in doc["groups"] if g["target"] == target and g["name"] == "double"), None)


def contradiction(cls: str, summary: dict[str, Any] | None) -> str | None:
    """Why the class contradicts the median overlap of the waves, or None when it does not."""
    ov = (summary or {}).get("overlap")
    if cls == "inconclusive":
        return None
    if ov is None:
        return None if cls in ("overlap not measurable", "rejects concurrent requests") else f"{cls} without an overlap"
    if cls == "serial" and ov > OVERLAP_SERIAL:
        return f"serial with overlap {ov:.2f} > {OVERLAP_SERIAL}"
    if cls in ("continuous batching", "batches, no gain") and ov < OVERLAP_BATCHING:
        return f"{cls} with overlap {ov:.2f} < {OVERLAP_BATCHING}"
    if cls == "partial batching" and not OVERLAP_SERIAL < ov < OVERLAP_BATCHING:
        return f"partial batching with overlap {ov:.2f}"
    return None


def row(doc: dict[str, Any], target: str) -> dict[str, Any]:
    text = (doc.get("verdicts") or {}).get(target, "")
    s = double_summary(doc, target) or {}
    cls = verdict_class(text)
    return {
        "verdict": text,
        "class": cls,
        "behaviour": behaviour(cls, text),
        "overlap": s.get("overlap"),
        "speedup": s.get("speedup"),
        "contradiction": contradiction(cls, s),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.integration.bench_live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json-dir", type=Path, default=None, help="keep each run's bench JSON here")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ",".join(SERVERS))
    args = ap.parse_args(argv)
    names = tuple(n for n in args.servers.split(",") if n)
    with tempfile.TemporaryDirectory(prefix="mlxproxy-benchlive-") as tmp:
        tmpdir = Path(tmp)
        out = args.json_dir or tmpdir
        out.mkdir(parents=True, exist_ok=True)
        model = build_loop_model(tmpdir / "model")
        with all_servers(model, tmpdir, names) as (urls, missing):
            for name, why in missing.items():
                print(f"SKIPPED {name}: {why}", flush=True)
            if not urls:
                print("no server could run", flush=True)
                return 1
            table: dict[str, list[dict[str, Any]]] = {n: [] for n in urls}
            for k in range(args.runs):
                cmd, doc = run_bench(
                    urls, out / f"bench-live-{k + 1}.json", max_tokens=args.max_tokens, repeat=args.repeat
                )
                if k == 0:
                    print("command: mlxproxy " + " ".join(cmd[3:]), flush=True)
                print(f"--- run {k + 1}", flush=True)
                for name in urls:
                    r = row(doc, name)
                    table[name].append(r)
                    print(
                        f"{name}: {r['verdict']}"
                        + (f"  [CONTRADICTS: {r['contradiction']}]" if r["contradiction"] else ""),
                        flush=True,
                    )
    print("--- summary", flush=True)
    bad = 0
    for name, rows in table.items():
        classes = [r["class"] for r in rows]
        decided = {c for c in classes if c != "inconclusive"}  # "inconclusive" (with its reason) is allowed
        same = len(decided) <= 1
        kinds = {r["behaviour"] for r in rows if r["behaviour"] != "inconclusive"}
        contra = [r["contradiction"] for r in rows if r["contradiction"]]
        bad += (len(kinds) > 1) + bool(contra)
        figs = "; ".join(
            f"overlap {r['overlap']:.2f} speedup {r['speedup']:.2f}x"
            if r["overlap"] is not None and r["speedup"] is not None
            else f"overlap {r['overlap']} speedup {r['speedup']}"
            for r in rows
        )
        print(
            f"{name}: {' | '.join(classes)} -> {'same' if same else 'gain differs'}, "
            f"{'same behaviour: ' + ', '.join(sorted(kinds)) if len(kinds) <= 1 else 'BEHAVIOUR DIFFERS'}"
            f"{'' if not contra else ', CONTRADICTS ' + '; '.join(contra)}  ({figs})",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
