"""Text shown to people: one line, cut at a whole word (sans-I/O, standard library only)."""

from __future__ import annotations

__all__ = ["clip"]


def clip(text: str, limit: int) -> str:
    """`text` on one line of at most `limit` characters, for error messages shown to a user: a
    longer one is cut after its last whole word (else after its last punctuation, so a
    number or a port is never cut short) and ends in "…"."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    cut = head.rfind(" ")
    if cut < limit // 2:  # one long token (a URL, a path): end it at a separator instead
        cut = max(head.rfind(c) for c in "/:,;)]}'\"")
        cut = cut + 1 if cut >= limit // 2 else len(head)
    return head[:cut].rstrip(" ,;:") + "…"
