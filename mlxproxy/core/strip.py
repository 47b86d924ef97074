"""Remove the usage-only event that the proxy's own `include_usage` injection added.

Pure: given the bytes of each read, the decoder items they completed and the decoder's
`safe_offset`, `process` returns the bytes to forward. Bytes of an event that is still
open are held back until the event is complete (a client cannot use half an event
anyway); every other byte is forwarded unchanged and in order.
"""

from __future__ import annotations

from mlxproxy.core.openai import is_injected_usage_chunk
from mlxproxy.core.sse import SSEDecoder, SSEEvent, SSEItem

__all__ = ["UsageStripper"]


class UsageStripper:
    __slots__ = ("_buf", "_start", "stripped")

    def __init__(self) -> None:
        self._buf = b""
        self._start = 0  # stream offset of self._buf[0]
        self.stripped = 0  # events removed

    def process(self, data: bytes, items: list[SSEItem], safe_offset: int) -> bytes:
        buf = self._buf + data if self._buf else data
        base = self._start
        cut = safe_offset - base
        pieces: list[bytes] | None = None  # only once an event is cut out
        pos = 0
        for it in items:
            # the substring test first: it rules out nearly every event without a call
            if isinstance(it, SSEEvent) and '"usage"' in it.data and is_injected_usage_chunk(it.data):
                s, e = it.start - base, it.end - base
                if pos <= s and e <= cut:
                    if pieces is None:
                        pieces = []
                    pieces.append(buf[pos:s])
                    pos = e
                    self.stripped += 1
        self._buf = buf[cut:]
        self._start = safe_offset
        if pieces is None:
            return buf[:cut]
        pieces.append(buf[pos:cut])
        return b"".join(pieces)

    def pass_whole(self, data: bytes, decoder: SSEDecoder) -> list[bytes] | None:
        """`process` for a read of whole data events none of which can be the usage event
        (`process` cuts only an event whose data holds `"usage"` with an object, which its
        bytes then hold too), while nothing is held back: the decoder takes them (`SSEDecoder.data_payloads`,
        their data undecoded) and `data` is forwarded whole. None: nothing consumed, use
        `SSEDecoder.feed` and `process`."""
        # (`partition`: cheaper than `find`, `SSEDecoder.data_payloads`) a `"usage"` that is each
        # time `"usage":null` (vllm-mlx writes it in every chunk) names no usage object: the
        # injected event's is one, and `process` cuts no other
        if self._buf or (
            data.partition(b'"usage"')[1]
            and data.count(b'"usage"') != data.count(b'"usage":null') + data.count(b'"usage": null')
        ):
            return None
        payloads = decoder.data_payloads(data)
        if payloads is not None:
            self._start += len(data)
        return payloads

    def flush(self) -> bytes:
        """End of body (or stripping no longer needed): everything still held back."""
        rest, self._buf = self._buf, b""
        self._start += len(rest)
        return rest
