"""A tiny, locally built MLX model and a managed ``mlx_lm.server`` for integration tests.

Nothing here touches the network except loopback: the model (config, random
weights, a byte-level BPE tokenizer trained on a built-in text, a ChatML chat
template) is written to a local folder, and the server is started with
``HF_HUB_OFFLINE=1`` and an empty ``HF_HUB_CACHE`` so it never tries a hub
download.

Public API:

* :func:`mlx_unavailable_reason` / :func:`requires_mlx` -- availability check.
* :func:`build_tiny_model` -- write the model folder.
* :func:`mlx_lm_server` -- context manager that runs ``mlx_lm.server`` on a free
  loopback port and yields its base URL (``http://127.0.0.1:PORT``).
* :data:`MODEL_NAME` -- the model name to send (``"default_model"``); any other
  name except the folder path would make the server look for a hub download.

Only the standard library is imported at module level, so importing this module
is safe where mlx is missing; the heavy imports happen inside the functions.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "MODEL_NAME",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "free_port",
    "mlx_lm_server",
    "mlx_unavailable_reason",
    "requires_mlx",
]

#: Name to put in the request's ``model`` field: the server maps it to ``--model``.
MODEL_NAME = "default_model"

#: Special tokens of the tiny tokenizer, in id order (ids 0, 1, 2).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML template (no ``<think>`` handling, so the server never switches to
#: its reasoning state: every generated token is plain ``content``).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Built-in training text for the tokenizer. Plain ASCII prose plus digits and
#: punctuation; byte-level BPE can still encode any input (every byte is in
#: the initial alphabet), this text only decides which merges exist.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A measuring proxy sits between a
client and a local language model server. It forwards every request, reads the
stream of server-sent events, and records the time to first token, the gap
between tokens, and the real number of tokens per second. When the server says
it produced one hundred tokens, the proxy counts the chunks it saw and compares.
Prompt processing comes first: the model reads the whole prompt in steps, and
only then does decoding begin, one token at a time, until the end token or the
limit. Keep the connection alive while the prompt is processed. Report usage.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
Punctuation: , . ; : ! ? ( ) [ ] { } < > " ' - _ = + * / \\ | @ # $ % ^ & ~ `
def main(): return {"role": "assistant", "content": "hello world"}
Hello! How are you today? I am fine, thank you. What is the weather like?
It is sunny and warm, with a light breeze from the west and a few clouds.
Write a short story about a robot who learns to paint pictures of the sea.
Once upon a time there was a small robot that lived by the ocean shore.
"""

# Small but real architecture: fast to load (well under a second) and fast to
# decode on one CPU core.
_ARCH_DEFAULTS: dict[str, object] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


_LM_HEAD_SCALE = 4.0


def _printable(text: str) -> bool:
    """True if ``text`` is non-empty and only printable ASCII, space or newline."""
    return bool(text) and all(c == "\n" or " " <= c <= "~" for c in text)


def mlx_unavailable_reason() -> str | None:
    """Return why the mlx stack cannot be used here, or ``None`` if it can.

    Checks that ``mlx.core``, ``mlx_lm``, ``mlx_lm.server``, ``tokenizers`` and
    ``safetensors`` import in this interpreter (the server is run with the same
    ``sys.executable``). Never raises.
    """
    for name in ("mlx.core", "mlx_lm", "mlx_lm.server", "tokenizers", "safetensors"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken native library
            return (
                f"{name} is not importable ({type(exc).__name__}: {exc}); "
                "install with: pip install 'mlx[cpu]' mlx-lm tokenizers safetensors"
            )
    return None


def requires_mlx() -> bool:
    """Return ``True`` if the mlx stack is usable; otherwise print the reason and return ``False``."""
    reason = mlx_unavailable_reason()
    if reason is not None:
        print(f"mlx unavailable: {reason}", file=sys.stderr)
        return False
    return True


def _train_tokenizer(vocab_size: int) -> object:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on :data:`TRAINING_TEXT`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tok


def build_tiny_model(
    dir: Path,
    *,
    seed: int = 0,
    architecture: str = "qwen3",
    vocab_size: int = 512,
    num_hidden_layers: int | None = None,
    hidden_size: int | None = None,
) -> Path:
    """Write a tiny, randomly initialised MLX chat model into ``dir`` and return ``dir``.

    ``dir`` is created if needed; existing files of the same names are
    overwritten. Files written: ``config.json``, ``generation_config.json``,
    ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``.

    Contract:

    * ``architecture`` is ``"qwen3"`` (default) or ``"llama"``.
    * The same ``seed`` (and other arguments) gives bit-identical weights and
      tokenizer, hence identical greedy output for the same request.
    * The vocabulary is a byte-level BPE trained on :data:`TRAINING_TEXT`
      (at most ``vocab_size`` entries; ``config.json``'s ``vocab_size`` equals
      the trained size so every sampled id decodes). Ids 0..2 are
      :data:`SPECIAL_TOKENS`; ``<|im_end|>`` is the EOS token.
    * Weights are random, so the model rarely emits EOS: replies normally run
      to ``max_tokens`` (``finish_reason == "length"``).
    * Needs mlx, mlx_lm and tokenizers (see :func:`mlx_unavailable_reason`).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if architecture not in ("qwen3", "llama"):
        raise ValueError(f"architecture must be 'qwen3' or 'llama', not {architecture!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(vocab_size)
    real_vocab = tok.get_vocab_size()
    tok.save(str(dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos_id = ids["<|im_end|>"]

    arch = dict(_ARCH_DEFAULTS)
    if num_hidden_layers is not None:
        arch["num_hidden_layers"] = num_hidden_layers
    if hidden_size is not None:
        arch["hidden_size"] = hidden_size
        arch["intermediate_size"] = 2 * hidden_size
        arch["head_dim"] = hidden_size // int(arch["num_attention_heads"])  # type: ignore[arg-type]

    config: dict[str, object] = {
        "architectures": ["Qwen3ForCausalLM" if architecture == "qwen3" else "LlamaForCausalLM"],
        "model_type": architecture,
        **arch,
        "vocab_size": real_vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if architecture == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    (dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": ids["<|endoftext|>"]}, indent=2) + "\n"
    )
    (dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )

    # Random weights from the real mlx_lm model class, so names and shapes
    # always match what the loader expects. mlx's default initialisers are
    # small uniform/normal values; seeding makes them reproducible.
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # Untied output head: zero the rows of tokens that do not decode to
    # printable ASCII (raw high bytes, control bytes, special tokens incl. EOS)
    # so they get logit 0 while the best printable token's logit is clearly
    # positive -- greedy output is then always readable text with one chunk
    # per token -- and scale the rest up so sampling is peaky, not uniform.
    allowed = mx.array([1.0 if _printable(tok.decode([i])) else 0.0 for i in range(real_vocab)])
    for i in ids.values():
        allowed[i] = 0.0
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = (head * (_LM_HEAD_SCALE * allowed[:, None])).astype(head.dtype)
    mx.eval(weights)
    mx.save_safetensors(str(dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dir


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to 0, then release).

    Racy by nature: another process can take it before the caller binds.
    :func:`mlx_lm_server` retries with a new port if its server fails to start.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _get(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _post_json(host: str, port: int, path: str, body: dict[str, object], timeout: float) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


KILLED_WAIT_S = 60.0


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after ``grace`` seconds) and reap it. A killed
    server is waited for up to `KILLED_WAIT_S`: on a loaded machine (2 cores, two CPU burners and
    other test runs) an mlx_lm.server once took longer than 5 s to go after SIGKILL, and the wait's
    timeout failed a run whose tests had all passed."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=KILLED_WAIT_S)


@contextlib.contextmanager
def mlx_lm_server(
    model_dir: Path,
    *,
    max_tokens: int = 64,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    startup_timeout: float = 60.0,
    warmup: bool = True,
    log_path: Path | None = None,
    attempts: int = 3,
) -> Iterator[str]:
    """Run ``python -m mlx_lm server --model model_dir`` on a free loopback port; yield ``http://host:port``.

    Contract:

    * The child runs with this interpreter, ``HF_HUB_OFFLINE=1``,
      ``HF_HUB_CACHE``/``HF_HOME`` pointing at fresh empty temp folders
      (``/v1/models`` needs an existing cache folder), and
      ``--max-tokens max_tokens`` (the default reply cap) plus ``extra_args``
      (e.g. ``["--prefill-step-size", "16"]``).
    * Ready means: ``GET /health`` answered 200 and, if ``warmup``, a 1-token
      ``/v1/completions`` request succeeded (``/health`` turns 200 as soon as
      the generation thread starts, *before* the model is loaded; the warm-up
      makes sure the model is loaded so later timings do not include the load).
      Not ready within ``startup_timeout`` seconds, or the child exiting, raises
      ``RuntimeError`` with the tail of the server log. A child that exits
      before ready (e.g. port taken) is retried on a new port, ``attempts``
      times in all.
    * Server output (stdout+stderr) goes to ``log_path`` if given, else to a
      temp file; it is never a pipe, so a chatty server cannot block.
    * On exit the child is terminated (SIGTERM, then SIGKILL) and reaped, and
      the temp folders are removed.
    * Send ``model`` as :data:`MODEL_NAME` or ``str(model_dir)`` (or omit it).
    """
    model_dir = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="mlxproxy-mlxlm-") as tmp:
        tmpdir = Path(tmp)
        hub_cache = tmpdir / "hf-cache"
        hub_cache.mkdir()
        hf_home = tmpdir / "hf-home"
        hf_home.mkdir()
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_CACHE=str(hub_cache),
            HF_HOME=str(hf_home),
            HF_HUB_DISABLE_TELEMETRY="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        log = Path(log_path) if log_path is not None else tmpdir / "server.log"
        last_error = "not started"
        for _attempt in range(max(1, attempts)):
            port = free_port(host)
            cmd = [
                sys.executable, "-m", "mlx_lm", "server",
                "--model", str(model_dir),
                "--host", host,
                "--port", str(port),
                "--max-tokens", str(max_tokens),
                *extra_args,
            ]  # fmt: skip
            with open(log, "ab") as logf:
                proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                ready, last_error = _wait_ready(proc, host, port, startup_timeout, warmup)
                if not ready:
                    if proc.poll() is not None:  # died: maybe the port was taken; retry
                        last_error += f"\n--- server log ---\n{_tail(log)}"
                        continue
                    raise RuntimeError(
                        f"mlx_lm.server not ready after {startup_timeout}s: {last_error}\n"
                        f"--- server log ---\n{_tail(log)}"
                    )
                yield f"http://{host}:{port}"
                return
            finally:
                _stop(proc)
        raise RuntimeError(f"mlx_lm.server failed to start after {attempts} attempts: {last_error}")


def _wait_ready(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float, warmup: bool) -> tuple[bool, str]:
    """Poll until the server is ready (see :func:`mlx_lm_server`); return ``(ready, last_error)``."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    healthy = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False, f"server exited with code {proc.returncode}"
        try:
            if not healthy:
                status, body = _get(host, port, "/health", timeout=2.0)
                healthy = status == 200
                last = f"/health -> {status} {body[:200]!r}"
            if healthy:
                if not warmup:
                    return True, ""
                remaining = max(1.0, deadline - time.monotonic())
                status, body = _post_json(
                    host, port, "/v1/completions",
                    {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "temperature": 0},
                    timeout=remaining,
                )  # fmt: skip
                if status == 200:
                    return True, ""
                last = f"warm-up /v1/completions -> {status} {body[:300]!r}"
                healthy = False
        except (OSError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.1)  # readiness polling interval, not a measurement
    return False, last
