"""Optional exact token counts with a local `tokenizer.json` (the `tokenizers` extra).

Nothing is ever downloaded: a tokenizer is a configured file, a model name that is a local
folder (mlx_lm.server accepts those), or a snapshot already in the local Hugging Face cache.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["TokenCounter", "find_tokenizer_file"]

log = logging.getLogger("mlxproxy")


def _hf_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def find_tokenizer_file(model: str) -> Path | None:
    """`tokenizer.json` for a model name: a local folder, or a cached hub snapshot. A name
    that cannot be a path (too long, a NUL byte) finds none rather than raising."""
    try:
        return _find_tokenizer_file(model)
    except (OSError, ValueError):
        return None


def _find_tokenizer_file(model: str) -> Path | None:
    p = Path(model).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p / "tokenizer.json"
    if "/" in model and not model.startswith(("/", ".")):
        folder = "models--" + model.replace("/", "--")
        for cache in _hf_cache_dirs():
            snaps = cache / folder / "snapshots"
            if snaps.is_dir():
                for snap in sorted(snaps.iterdir(), key=lambda x: x.stat().st_mtime, reverse=True):
                    if (snap / "tokenizer.json").is_file():
                        return snap / "tokenizer.json"
    return None


class TokenCounter:
    """Resolves and caches a counting function per model name (None: no tokenizer)."""

    def __init__(self, path: str | None = None, search: bool = True) -> None:
        self.path = path
        self.search = search
        self._cache: dict[str | None, Callable[[str], int] | None] = {}
        self._fixed: Callable[[str], int] | None = self._load(Path(path)) if path else None

    @staticmethod
    def _load(path: Path) -> Callable[[str], int] | None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            log.warning(
                "tokenizer %s configured but the 'tokenizers' package is missing: pip install 'mlxproxy[tokenizers]'",
                path,
            )
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # a broken file must not stop the proxy
            log.warning("cannot load tokenizer %s: %s", path, exc)
            return None

        def count(text: str) -> int:
            return len(tok.encode(text, add_special_tokens=False).ids)

        return count

    def for_model(self, model: str | None) -> Callable[[str], int] | None:
        if self._fixed is not None or not self.search or not model:
            return self._fixed
        if model not in self._cache:
            found = find_tokenizer_file(model)
            self._cache[model] = self._load(found) if found else None
        return self._cache[model]
