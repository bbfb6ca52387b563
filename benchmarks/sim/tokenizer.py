"""Deterministic built-in tokenizer and chat template of the simulated endpoint.

The simulated endpoint has no real model, but prefix caching only works if equal prompt text
gives equal leading token ids, and the timing model needs a token count that grows with the text
like a real BPE vocabulary does (about four characters per token). This module provides both
without any model files:

    text ──regex──> pieces ──long pieces cut into 4-char chunks──> xxhash32(piece) → id

- A piece is a run of word characters with the whitespace before it (``" hello"``), a single
  punctuation character with the whitespace before it, or trailing whitespace. Attaching the
  leading whitespace to the word (as GPT-style tokenizers do) keeps the count near four
  characters per token for English text.
- Pieces longer than ``_MAX_PIECE_CHARS`` are cut into ``_CHUNK_CHARS``-character chunks from the
  left, so appending text can only change the last piece of a prefix: ``encode(a + b)`` starts
  with ``encode(a)[:-1]``.
- The chat markers ``<|im_start|>`` and ``<|im_end|>`` are single reserved ids, as special tokens
  are in a real vocabulary.

Ids ``0..RESERVED_IDS-1`` are reserved for special tokens; every other piece maps to
``RESERVED_IDS + xxhash32(piece) % (VOCAB_SIZE - RESERVED_IDS)``. ``decode`` is not the inverse
of ``encode`` (hashes cannot be reversed): it turns generated ids into words from a fixed list,
which is all the endpoint needs to produce output text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xxhash

VOCAB_SIZE = 32_000
RESERVED_IDS = 100

PAD_ID = 0
IM_START_ID = 1
IM_END_ID = 2
EOS_ID = 3

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_SPECIAL_IDS: dict[str, int] = {IM_START: IM_START_ID, IM_END: IM_END_ID}

# Longest piece kept whole; longer ones are cut into fixed chunks from the left.
_MAX_PIECE_CHARS = 6
_CHUNK_CHARS = 4

# Alternatives are tried left to right: special markers, whitespace+word, whitespace+one
# punctuation character that does not open a marker, then whitespace that no word or
# punctuation follows (end of text or before a marker). Every character is matched by exactly
# one piece, and a marker is always a piece of its own.
_PIECE_RE = re.compile(
    r"<\|im_start\|>|<\|im_end\|>|\s*\w+|\s*(?!<\|im_(?:start|end)\|>)[^\w\s]|\s+",
)

_ID_SPAN = VOCAB_SIZE - RESERVED_IDS

# Output vocabulary: short, distinct words so generated text looks like text and stays ASCII.
_OUTPUT_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "cache", "block", "token",
    "model", "route", "query", "time", "batch", "prefix", "value", "state", "queue", "graph",
    "layer", "point", "field",
)  # fmt: skip


def _piece_id(piece: str) -> int:
    return RESERVED_IDS + xxhash.xxh32_intdigest(piece.encode("utf-8")) % _ID_SPAN


def encode(text: str) -> list[int]:
    """Tokenizes text into ids in ``[0, VOCAB_SIZE)``.

    Args:
        text: Any Unicode text; the empty string gives an empty list.

    Returns:
        The token ids. Equal texts always give equal ids, across processes and machines.
    """
    ids: list[int] = []
    append = ids.append
    for match in _PIECE_RE.finditer(text):
        piece = match.group()
        special = _SPECIAL_IDS.get(piece)
        if special is not None:
            append(special)
            continue
        if len(piece) <= _MAX_PIECE_CHARS:
            append(_piece_id(piece))
            continue
        for start in range(0, len(piece), _CHUNK_CHARS):
            append(_piece_id(piece[start : start + _CHUNK_CHARS]))
    return ids


def decode_token(token_id: int) -> str:
    """Returns the output text of one generated token id (a space and a word).

    Args:
        token_id: Any non-negative id.

    Returns:
        The text, e.g. ``" cache"``; special ids give the empty string.
    """
    if token_id < RESERVED_IDS:
        return ""
    return " " + _OUTPUT_WORDS[token_id % len(_OUTPUT_WORDS)]


def decode(token_ids: Iterable[int]) -> str:
    """Turns generated token ids into output text.

    This is not the inverse of :func:`encode`; see the module docstring.

    Args:
        token_ids: Ids produced by the engine.

    Returns:
        The concatenated text of every id.
    """
    return "".join(decode_token(token_id) for token_id in token_ids)


def content_text(content: Any) -> str:
    """Extracts the text of an OpenAI chat message ``content`` field.

    Args:
        content: A string, ``None`` (e.g. an assistant turn with tool calls only), or a list of
            content parts of which the ``{"type": "text", "text": ...}`` ones are joined.

    Returns:
        The text.

    Raises:
        ValueError: If the content has another shape.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping):
                raise ValueError("content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("a text content part needs a string 'text'")
                texts.append(text)
        return "".join(texts)
    raise ValueError("content must be a string, a list of content parts or null")


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Applies the fixed chat template of the simulated model.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the prompt ends with
    the generation prompt ``<|im_start|>assistant\\n`` (a ChatML-style template, as many open
    models use). Because earlier turns render identically, a multi-turn conversation's later
    requests share the leading token ids of the earlier ones.

    Args:
        messages: OpenAI chat messages with a string ``role`` and a ``content``
            (see :func:`content_text`).

    Returns:
        The prompt text.

    Raises:
        ValueError: If a message is not an object or lacks a string role.
    """
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a string 'role'")
        parts.append(f"{IM_START}{role}\n{content_text(message.get('content'))}{IM_END}\n")
    parts.append(f"{IM_START}assistant\n")
    return "".join(parts)
