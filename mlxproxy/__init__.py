"""mlxproxy: an OpenAI-compatible measuring proxy for local LLM servers."""

from __future__ import annotations

__version__ = "0.1.0"
