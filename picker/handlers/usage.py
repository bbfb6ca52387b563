"""Read token usage from a response on its way past, without holding the response up.

- JSON responses: the body is kept (up to a cap) and ``usage`` read at the end.
- SSE responses: each ``data:`` line that mentions ``usage`` is decoded; the last usage seen
  wins (vLLM sends it in the final chunk when ``stream_options.include_usage`` is set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_MAX_JSON_BYTES = 1 << 20
_MAX_LINE_BYTES = 1 << 16


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def usage_from_document(document: Any) -> Usage | None:
    """The ``usage`` object of an OpenAI-style response or chunk, if it has one."""
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_int(usage.get("prompt_tokens", usage.get("input_tokens"))),
        completion_tokens=_int(usage.get("completion_tokens", usage.get("output_tokens"))),
        cached_tokens=cached or 0,
    )


class UsageReader:
    """Feed response body chunks; ask for the usage at the end."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self._buffer = bytearray()
        self._overflow = False
        self._usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if self.streaming:
            self._buffer += chunk
            *lines, rest = self._buffer.split(b"\n")
            for line in lines:
                self._line(bytes(line))
            self._buffer = bytearray(rest[-_MAX_LINE_BYTES:])
        elif not self._overflow:
            if len(self._buffer) + len(chunk) > _MAX_JSON_BYTES:
                self._overflow = True
                self._buffer.clear()
            else:
                self._buffer += chunk

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:") or b"usage" not in line:
            return
        payload = line[5:].strip()
        try:
            usage = usage_from_document(json.loads(payload))
        except (ValueError, RecursionError):
            return
        if usage is not None:
            self._usage = usage

    def result(self) -> Usage | None:
        if self.streaming:
            if self._buffer:
                self._line(bytes(self._buffer))
                self._buffer.clear()
            return self._usage
        if self._overflow or not self._buffer:
            return None
        try:
            return usage_from_document(json.loads(bytes(self._buffer)))
        except (ValueError, RecursionError):
            return None
