"""Exact token counts from a local tokenizer.json: found without any download."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fakeupstream import FakeUpstream, sse_response
from mlxproxy.proxy.tokens import TokenCounter, find_tokenizer_file
from support import last_record, proxy, read_fixture

tokenizers = pytest.importorskip("tokenizers")


def make_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["Hello world, hello there, let me think."] * 50, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_found_in_local_folder_and_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "model"
    make_tokenizer(folder / "tokenizer.json")
    assert find_tokenizer_file(str(folder)) == folder / "tokenizer.json"
    cache = tmp_path / "hub"
    snap = make_tokenizer(cache / "models--org--tiny" / "snapshots" / "abc123" / "tokenizer.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert find_tokenizer_file("org/tiny") == snap
    assert find_tokenizer_file("org/absent") is None and find_tokenizer_file("plain-name") is None
    counter = TokenCounter(search=True)
    count = counter.for_model("org/tiny")
    assert count is not None and count("Hello world") >= 2
    assert counter.for_model("org/absent") is None


def test_broken_tokenizer_file_is_ignored(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    assert TokenCounter(str(bad)).for_model("anything") is None


def test_proxy_uses_configured_tokenizer_for_exact_usage_check(tmp_path: Path) -> None:
    path = make_tokenizer(tmp_path / "tokenizer.json")
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    with FakeUpstream(sse_response(body)) as up, proxy(up.url, tokenizer=str(path)) as (url, app):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "stream": True, "messages": []})
        rec = last_record(app, r.headers["x-mlxproxy-request-id"])
    expected = len(tokenizers.Tokenizer.from_file(str(path)).encode("Hello world", add_special_tokens=False).ids)
    assert rec.completion_tokens_tokenizer == expected and rec.completion_tokens_counted == 2
