"""Tokenization for precise mode: the prompt's token ids exactly as the model server sees them.

Precise routing matches a request's blocks against blocks the endpoints report, and those blocks
are token ids, so the picker must tokenize like vLLM does:

- a Hugging Face ``tokenizer.json`` loaded from a local path with the ``tokenizers`` library
  (never a hub download);
- for chat requests, the chat template of the model's ``tokenizer_config.json`` rendered with
  jinja2 in a sandbox (as ``transformers`` does: ``messages``, ``add_generation_prompt``,
  ``bos_token``/``eos_token``, ``raise_exception``), then tokenized without adding special tokens
  (the template carries them); completions get the tokenizer's special tokens;
- only the head of a long prompt matters when at most ``max_tokens`` tokens are matched: the
  text is cut well past what those tokens can span (``max_tokens`` × the longest vocabulary
  entry + a margin). Byte-level pre-tokenization splits text into words that are tokenized
  independently, so only the word at the cut can tokenize differently, and it lies beyond the
  tokens kept.

Encoding costs about 11 µs per 100 characters on the benchmarks' 2-core machine (a 4,000-token
prompt takes about 1.8 ms), and chat requests repeat long pieces: the same system prompt,
earlier turns.
Added tokens (``<|im_start|>`` and the like) split the text into pieces that ``tokenizers``
encodes independently of each other, so the picker splits there too and keeps the ids of long
pieces in an LRU cache (``_CACHE_MAX_CHARS``): a conversation's shared prefix is tokenized
once. The split is only used when it is exact: every added token matched on the raw text
without stripping or word boundaries, and no post-processor adding tokens. Every encoding goes
through ``encode_batch_fast``: the same ids without the offsets ``encode`` also computes (about a
third less time), and the GIL released while it runs, so long prompts run on the event loop's
default thread pool (:func:`encode_async`) without holding up the loop.

Completion prompts have no added tokens to split at, so a long piece is also cut into chunks of
about ``chunk_chars`` (2,048) characters, each encoded and cached on its own: requests that share
a long text prefix share its chunks, and only the tail that differs is tokenized. That is exact
when the tokenizer is byte-level BPE (no normalizer, byte-level pre-tokenization without a
prefix space): BPE never merges across the pre-tokenizer's words, so a cut at a word's start
changes nothing. A cut is placed before a space that follows a non-space and precedes a letter
(where GPT-2-style pre-tokenizers start a word), and only where the tokenizer's own
pre-tokenizer, run over the cut's neighbourhood, starts a word there too. Other tokenizers are
not chunked; a self-check at load time turns chunking off if a sample tokenizes differently.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from kv_picker.request import Prompt

_HEAD_MARGIN_CHARS = 1024
_CACHE_MIN_CHARS = 256  # shorter pieces cost less to encode than to cache
_CACHE_MAX_CHARS = 4_000_000
CHUNK_CHARS = 2048
_CUT_SEARCH_CHARS = 128  # how far past a chunk's nominal end a cut is looked for
_CUT_WINDOW_CHARS = 48  # the neighbourhood the pre-tokenizer checks a cut in


class TokenizerError(ValueError):
    """A tokenizer or its chat template cannot be loaded or applied."""


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


class PromptTokenizer:
    """A model's tokenizer and chat template.

    Args:
        tokenizer: the loaded ``tokenizers.Tokenizer``.
        chat_template: jinja2 source of the chat template ("" = chat requests unsupported).
        special_tokens: ``bos_token``/``eos_token`` values passed to the template.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str = "",
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.special_tokens = dict(special_tokens or {})
        self._splitter, self._added_ids = _added_token_splitter(tokenizer)
        self.chunk_chars = CHUNK_CHARS if _byte_level_bpe(tokenizer) else 0
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._cache_lock = threading.Lock()  # encode_async runs on pool threads
        # tokenizers >= 0.20 (ids only); older ones compute offsets too.
        self._batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.cache_hits = 0
        self._template: jinja2.Template | None = None
        if chat_template:
            # The environment transformers renders chat templates in.
            environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            environment.globals["raise_exception"] = _raise_exception
            try:
                self._template = environment.from_string(chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat template does not compile: {exc}") from exc
        if self.chunk_chars and not self._chunking_is_exact():
            self.chunk_chars = 0

    def _chunking_is_exact(self) -> bool:
        """Encode a sample whole and in chunks; chunking stays on only if they agree."""
        words = ["The", "model's", "KV-cache", "holds", "12,345", "blocks;", "naïve", "Überall",
                 "x=y+1", "(see", "§4.2)", "\n\n", "tab\there", "don't", "  two", "Ω", "日本語"]  # fmt: skip
        sample = " ".join(words[(i * 7) % len(words)] for i in range(600))
        chunk_chars, self.chunk_chars = self.chunk_chars, 97
        try:
            chunked = self._chunked(sample)
        finally:
            self.chunk_chars = chunk_chars
            self._cache.clear()
            self._cached_chars = 0
            self.cache_hits = 0
        return chunked == self._raw(sample, False)

    @classmethod
    def load(cls, path: str | Path) -> PromptTokenizer:
        """Load ``tokenizer.json`` (and ``tokenizer_config.json`` beside it, when present).

        Args:
            path: a model directory holding ``tokenizer.json``, or the file itself.

        Raises:
            TokenizerError: the files are missing or invalid.
        """
        path = Path(path)
        tokenizer_path = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise TokenizerError(f"{tokenizer_path}: cannot load tokenizer: {exc}") from exc
        config_path = tokenizer_path.parent / "tokenizer_config.json"
        template = ""
        special: dict[str, str] = {}
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_path}: {exc}") from exc
            raw_template = config.get("chat_template") or ""
            if isinstance(raw_template, list):  # named templates: use "default"
                named = {t.get("name"): t.get("template") for t in raw_template}
                raw_template = named.get("default") or ""
            template = raw_template if isinstance(raw_template, str) else ""
            for name in ("bos_token", "eos_token"):
                value = config.get(name)
                if isinstance(value, Mapping):  # AddedToken form
                    value = value.get("content")
                if isinstance(value, str):
                    special[name] = value
        return cls(tokenizer, template, special)

    # -- text -------------------------------------------------------------------------------

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of chat messages as the template sees them (``role`` and a string
        ``content`` each, plus whatever else the template reads).

        Raises:
            TokenizerError: no chat template, a message without a string role and content, or
                the template refused.
        """
        if self._template is None:
            raise TokenizerError("the tokenizer has no chat template")
        for message in messages:
            if not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise TokenizerError("each message needs a string 'role' and 'content'")
        normalised = messages
        try:
            return self._template.render(
                messages=normalised,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.special_tokens.get("bos_token", ""),
                eos_token=self.special_tokens.get("eos_token", ""),
            )
        except TokenizerError:
            raise
        except Exception as exc:  # jinja2 errors, or a template indexing a missing key
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def head(self, text: str, max_tokens: int) -> str:
        """The part of ``text`` whose tokenization starts with the first ``max_tokens``."""
        if max_tokens <= 0:
            return text
        limit = max_tokens * self.max_token_chars + _HEAD_MARGIN_CHARS
        return text if len(text) <= limit else text[:limit]

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int = 0) -> list[int]:
        """Token ids of ``text`` (the first ``max_tokens`` when > 0)."""
        ids = self._encode(self.head(text, max_tokens), add_special_tokens)
        return ids[:max_tokens] if max_tokens > 0 else ids

    def _raw(self, text: str, add_special_tokens: bool) -> list[int]:
        (encoding,) = self._batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        splitter = self._splitter
        if splitter is None or len(text) < _CACHE_MIN_CHARS:
            return self._raw(text, add_special_tokens)
        ids: list[int] = []
        position = 0
        added_ids = self._added_ids
        for match in splitter.finditer(text):
            start = match.start()
            if start > position:
                ids += self._piece(text[position:start])
            ids.append(added_ids[match.group()])
            position = match.end()
        if position < len(text):
            ids += self._piece(text[position:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < _CACHE_MIN_CHARS:
            return self._raw(piece, False)
        if self.chunk_chars and len(piece) > 2 * self.chunk_chars:
            return self._chunked(piece)
        return self._cached(piece)

    def _chunked(self, piece: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for cut in self._cuts(piece):
            ids += self._cached(piece[start:cut])
            start = cut
        ids += self._cached(piece[start:])
        return ids

    def _cuts(self, text: str) -> list[int]:
        """Where ``text`` may be cut without changing its tokens, about every chunk."""
        cuts: list[int] = []
        size = self.chunk_chars
        position = size
        limit = len(text) - size // 2  # leave the tail a chunk of some length
        pre_tokenize = self.tokenizer.pre_tokenizer.pre_tokenize_str
        while position < limit:
            end = min(position + _CUT_SEARCH_CHARS, limit)
            cut = text.find(" ", position, end)
            while cut != -1:
                before, after = text[cut - 1], text[cut + 1] if cut + 1 < len(text) else ""
                if not before.isspace() and after.isalpha():
                    window_start = max(0, cut - _CUT_WINDOW_CHARS)
                    window = text[window_start : cut + _CUT_WINDOW_CHARS]
                    starts = {offsets[0] for _, offsets in pre_tokenize(window)}
                    if cut - window_start in starts:
                        break
                cut = text.find(" ", cut + 1, end)
            if cut == -1:
                position = end  # no word starts here: look further on
                continue
            cuts.append(cut)
            position = cut + size
        return cuts

    def _cached(self, piece: str) -> list[int]:
        cache = self._cache
        with self._cache_lock:
            cached = cache.get(piece)
            if cached is not None:
                cache.move_to_end(piece)
                self.cache_hits += 1
                return cached
        ids = self._raw(piece, False)
        with self._cache_lock:
            if piece not in cache:
                cache[piece] = ids
                self._cached_chars += len(piece)
                while self._cached_chars > _CACHE_MAX_CHARS and cache:
                    old, _ = cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids

    async def encode_async(
        self, text: str, add_special_tokens: bool = True, max_tokens: int = 0
    ) -> list[int]:
        """:meth:`encode` on the loop's default thread pool (for long prompts)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, partial(self.encode, text, add_special_tokens, max_tokens)
        )


@dataclass(slots=True)
class PromptInput:
    """What to tokenize for one request: text, or token ids the client sent already."""

    text: str = ""
    add_special_tokens: bool = True
    token_ids: list[int] | None = None


def _byte_level_bpe(tokenizer: Tokenizer) -> bool:
    """Byte-level BPE with the GPT-2-style word split and no prefix space (chunkable)."""
    try:
        spec = json.loads(tokenizer.to_str())
    except ValueError:
        return False
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        pre = parts[0] if len(parts) == 1 else {}
    return (
        spec.get("normalizer") is None
        and (spec.get("model") or {}).get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space", True)
        and bool(pre.get("use_regex", True))
    )


def _added_token_splitter(tokenizer: Tokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A regex matching the added tokens as ``tokenizers`` splits on them, when that is exact."""
    try:
        added = tokenizer.get_added_tokens_decoder()
    except AttributeError:  # older tokenizers
        return None, {}
    if not added or tokenizer.post_processor is not None or tokenizer.encode_special_tokens:
        return None, {}
    ids: dict[str, int] = {}
    for token_id, token in added.items():
        content = token.content
        if not content or token.lstrip or token.rstrip or token.single_word:
            return None, {}
        if token.normalized and tokenizer.normalizer is not None:
            return None, {}
        ids[content] = token_id
    # Longest first: at one position the longest added token wins, as in tokenizers.
    alternatives = sorted(ids, key=len, reverse=True)
    return re.compile("|".join(re.escape(a) for a in alternatives)), ids


def prompt_input(tokenizer: PromptTokenizer, prompt: Prompt) -> PromptInput | None:
    """What to tokenize for a prompt, as the model server will.

    Chat messages go through the chat template; a completion prompt is its text or token ids
    (the first prompt of a batch, as :mod:`kv_picker.request` defines). None when the prompt is
    of no known shape (the caller tokenizes its text).

    Raises:
        TokenizerError: the chat messages cannot be rendered.
    """
    if prompt.kind == "chat":
        if not prompt.messages:
            return None
        # Each message's text content (see kv_picker.request for why other parts are left out).
        messages = [{**m.extra, "role": m.role, "content": m.content} for m in prompt.messages]
        return PromptInput(tokenizer.render_chat(messages, prompt.add_generation_prompt), False)
    if prompt.kind == "completions":
        if prompt.token_ids is not None:
            return PromptInput(token_ids=list(prompt.token_ids))
        return PromptInput(prompt.text)
    return None
