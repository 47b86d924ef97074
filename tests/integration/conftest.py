"""Shared real peers: one tiny local model and one ``mlx_lm.server`` for the whole session.

The server runs with ``--prefill-step-size 16`` so a prompt of a few hundred tokens is
processed in many steps (many ``: keepalive P/T`` comments, and a TTFT large enough to
compare), on its own CPU cores where the platform allows (``peers.split_cpus``). Tests
that need the mlx stack skip with the reason where it does not import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from .live_servers import RiggedVllm
from .peers import CLIENT_CPUS, SERVER_CPUS, cpu_affinity
from .tinymodel import mlx_unavailable_reason

#: Server-side default reply cap (``--max-tokens``).
SERVER_MAX_TOKENS = 64
#: Prefill step of the shared server.
PREFILL_STEP = 16


def _require_mlx() -> None:
    reason = mlx_unavailable_reason()
    if reason is not None:
        pytest.skip(f"mlx stack unavailable: {reason}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder (config, weights, tokenizer.json, chat template)."""
    _require_mlx()
    from .tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)


@pytest.fixture(scope="session")
def mlx_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a real ``mlx_lm.server`` serving the tiny model (shared by the session)."""
    from .tinymodel import mlx_lm_server

    log = tmp_path_factory.mktemp("mlx-lm-log") / "server.log"
    with contextlib.ExitStack() as stack:
        with cpu_affinity(SERVER_CPUS):  # the child keeps these cores (see peers.split_cpus)
            url = stack.enter_context(
                mlx_lm_server(
                    tiny_model,
                    max_tokens=SERVER_MAX_TOKENS,
                    extra_args=["--prefill-step-size", str(PREFILL_STEP)],
                    log_path=log,
                )
            )
        yield url


@pytest.fixture(scope="session")
def rigged_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rigged model fixed to one answer (``<think>...</think>`` then "It is sunny today."),
    whatever it is asked: for the agent CLIs, whose long prompts and own tools a free model would
    answer at length (and whose answers would change what they send next)."""
    _require_mlx()
    from .rigged import answer_always, build_rigged_model

    rig = build_rigged_model(tmp_path_factory.mktemp("rigged") / "model")
    answer_always(rig, "<|rig_think|>")
    return rig.path


@pytest.fixture(scope="session")
def rigged_vllm(rigged_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RiggedVllm]:
    """vllm-mlx serving the rigged model, shared by the session's agent tests."""
    from .live_servers import live_server, unavailable_reason

    reason = unavailable_reason("vllm-mlx")
    if reason is not None:
        pytest.skip(reason)
    log = tmp_path_factory.mktemp("vllm-mlx-log") / "server.log"
    try:
        with live_server("vllm-mlx", rigged_model, log_path=log) as server:
            yield RiggedVllm(server, rigged_model)
    except RuntimeError as exc:
        pytest.skip(f"vllm-mlx did not start: {str(exc)[-1500:]}")


@pytest.fixture(autouse=True)
def _off_the_server_cores() -> Iterator[None]:
    """Each test's own client work (and children it starts) stays off the model
    server's cores, as in real use where the model runs elsewhere (GPU)."""
    with cpu_affinity(CLIENT_CPUS):
        yield
