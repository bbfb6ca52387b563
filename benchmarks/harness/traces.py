"""Trace inputs: Mooncake JSONL, kv-picker JSONL and the synthetic workload families.

Every source becomes one shape, a :class:`Trace` of :class:`TraceRequest` rows, so the offline
simulator, the live replay and the peer replay all see identical requests. A request carries
no tokens: its prompt is a list of *block ids*, one per ``block_tokens``-token block, where equal
ids at equal positions mean equal token blocks (and, because ids are chained prefix hashes,
equal prefixes). That is the Mooncake representation, and it is enough for exact prefix-cache
accounting. The records live in :mod:`~kv_picker_bench.harness.trace_model` and the generators
in :mod:`~kv_picker_bench.harness.families`; this module re-exports both, so callers import
traces from here.

```
hash_ids:   [ 0 ][ 14 ][ 15 ][ 16 ]        block_tokens = 512, input_tokens = 1800
tokens:     0..511 512..1023 ... 1536..1799  (last block partial: 264 tokens)
text:       " qzk wab ..." 4 chars per token, one fixed pseudo-random chunk per content id
engine:     32 blocks of 16 tokens per id    (simulator keys: id * 32 + j)
```

Text: routers that hash prompt *text* (kv-picker's approximate prefix scorer, SGLang's radix
tree) need a string, so each id maps to a fixed pseudo-random run of 3-letter words, one word
per token (``" abc"``, four characters). The simulated endpoint's tokenizer turns each such word
into exactly one token, so the same text sent over HTTP in live mode has exactly
``input_tokens`` tokens and the same block structure.

Adapters and salts: a request's LoRA adapter and ``cache_salt`` put its ids in a cache
namespace (:mod:`~kv_picker_bench.harness.trace_model`), so its blocks never match another
adapter's or salt's, as in vLLM. The text is made from the *content* ids
(:attr:`TraceRequest.content_ids`, the ids without the namespace): two tenants sending the
same system prompt send the same characters, and only the salt (which the simulator puts in
``LLMRequest.cache_salt`` and live mode in the body) tells them apart.

Our own JSONL format (``kv-picker-trace``), one JSON object per line::

    {"kv_picker_trace": 1, "block_tokens": 16, "name": "my-trace"}          optional header
    {"arrival_s": 0.0, "input_tokens": 700, "output_tokens": 64, "hash_ids": [1, 2, ...]}
    {"arrival_s": 0.4, "prompt": "any text", "output_tokens": 64, "session": "user-7"}
    {"arrival_s": 0.9, "input_tokens": 700, "output_tokens": 64, "hash_ids": [1, 2, ...],
     "lora": "sql-adapter", "cache_salt": "tenant-a"}

- ``arrival_s`` (seconds, >= 0), ``output_tokens`` (>= 1) are required.
- Either ``hash_ids`` (with ``input_tokens``; ``len(hash_ids) == ceil(input_tokens /
  block_tokens)``) or ``prompt`` (text, tokenized with the simulated endpoint's tokenizer,
  whose token blocks get chained ids) is required.
- ``session`` (string) is optional: live replays send it as ``x-session-id``.
- ``output_hash_ids`` is optional: ids of the blocks of prompt plus output
  (``ceil((input_tokens + output_tokens) / block_tokens)`` of them), so a later request that
  continues the conversation hits the blocks decode filled.
- ``lora`` (the adapter named as the model) and ``cache_salt`` (non-empty strings) are
  optional. ``hash_ids`` and ``output_hash_ids`` name *content*: equal ids under another
  adapter or salt are other blocks. When a file uses either field, every id must be below
  ``2**40`` (the namespace sits above).
- ``block_tokens`` defaults to 16 (vLLM's default block size) when there is no header.

Errors name the file, the line and the field.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import xxhash

from kv_picker_bench.harness.families import (
    FAMILIES,
    GENERATORS,
    LLMD_STAGES,
    ChatSpec,
    Family,
    SharedPrefixSpec,
    build_generator,
)
from kv_picker_bench.harness.synthesis import parse_stages, poisson_arrivals, staged_arrivals
from kv_picker_bench.harness.trace_model import (
    CONTENT_ID_LIMIT,
    DEFAULT_BLOCK_TOKENS,
    CacheNamespaces,
    Trace,
    TraceError,
    TraceRequest,
    renumber_by_arrival,
)

__all__ = [
    "CHARS_PER_TOKEN",
    "CONTENT_ID_LIMIT",
    "DEFAULT_BLOCK_TOKENS",
    "FAMILIES",
    "GENERATORS",
    "KV_PICKER_TRACE_VERSION",
    "LLMD_STAGES",
    "MOONCAKE_BLOCK_TOKENS",
    "CacheNamespaces",
    "ChatSpec",
    "Family",
    "SharedPrefixSpec",
    "Trace",
    "TraceError",
    "TraceRequest",
    "block_text",
    "iter_ids",
    "load_kv_picker_jsonl",
    "load_mooncake",
    "load_trace",
    "parse_stages",
    "parse_trace_spec",
    "poisson_arrivals",
    "prompt_text",
    "scale_rate",
    "slice_trace",
    "staged_arrivals",
    "write_kv_picker_jsonl",
]

CHARS_PER_TOKEN = 4
"""Characters of synthesized prompt text per token (one 3-letter word and a space)."""

MOONCAKE_BLOCK_TOKENS = 512
KV_PICKER_TRACE_VERSION = 1


# --------------------------------------------------------------------------------- text


_LETTERS = bytes(ord("a") + i % 26 for i in range(256))
_TEXT_POOL_WORDS = 1 << 22  # 16 MiB of text: ids collide on the same chunk about 1 in 4M


@functools.cache
def _text_pool() -> str:
    """A fixed run of random 3-letter words; each block id reads its own window of it.

    Slicing one shared string is far cheaper than generating text per id (prompts of the
    Mooncake trace average 48,000 characters), and the pool is the same in every process.
    """
    raw = random.Random(0x6B7670).randbytes(3 * _TEXT_POOL_WORDS)
    letters = raw.translate(_LETTERS)
    out = bytearray(b" " * (CHARS_PER_TOKEN * _TEXT_POOL_WORDS))
    out[1::4] = letters[0::3]
    out[2::4] = letters[1::3]
    out[3::4] = letters[2::3]
    return out.decode("ascii")


def _block_offset(hash_id: int, block_tokens: int) -> int:
    position = xxhash.xxh3_64_intdigest(hash_id.to_bytes(8, "little"), seed=block_tokens)
    return CHARS_PER_TOKEN * (position % (_TEXT_POOL_WORDS - block_tokens))


def block_text(hash_id: int, num_tokens: int, block_tokens: int) -> str:
    """The fixed text of a block id: ``num_tokens`` words of the form ``" abc"``.

    Args:
        hash_id: The block id.
        num_tokens: Tokens of the block to render (the last block of a prompt may be partial).
        block_tokens: The trace's block size (part of the text's seed).
    """
    start = _block_offset(hash_id, block_tokens)
    return _text_pool()[start : start + CHARS_PER_TOKEN * min(num_tokens, block_tokens)]


def prompt_text(request: TraceRequest, block_tokens: int) -> str:
    """The request's prompt text: its own, or one chunk per content id (equal content, equal
    text, whatever the adapter or salt)."""
    if request.prompt is not None:
        return request.prompt
    ids = request.content_ids
    if not ids:
        return ""
    pool = _text_pool()
    chunk_chars = CHARS_PER_TOKEN * block_tokens
    offsets = [_block_offset(hash_id, block_tokens) for hash_id in ids]
    last_chars = CHARS_PER_TOKEN * (request.input_tokens - (len(ids) - 1) * block_tokens)
    parts = [pool[start : start + chunk_chars] for start in offsets[:-1]]
    parts.append(pool[offsets[-1] : offsets[-1] + last_chars])
    return "".join(parts)


# ------------------------------------------------------------------------------ loaders


def _fail(path: str, line: int, field_name: str, message: str) -> TraceError:
    return TraceError(f"{path}:{line}: field {field_name!r}: {message}")


def _int_field(row: dict[str, Any], key: str, path: str, line: int, minimum: int) -> int:
    if key not in row:
        raise _fail(path, line, key, "missing")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, line, key, f"expected an integer, got {value!r}")
    if value < minimum:
        raise _fail(path, line, key, f"must be >= {minimum}, got {value}")
    return value


def _number_field(row: dict[str, Any], key: str, path: str, line: int) -> float:
    if key not in row:
        raise _fail(path, line, key, "missing")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(path, line, key, f"expected a number, got {value!r}")
    if value < 0:
        raise _fail(path, line, key, f"must be >= 0, got {value}")
    return float(value)


def _hash_ids_field(
    row: dict[str, Any], path: str, line: int, input_tokens: int, block_tokens: int
) -> list[int]:
    if "hash_ids" not in row:
        raise _fail(path, line, "hash_ids", "missing")
    ids = row["hash_ids"]
    if not isinstance(ids, list):
        raise _fail(path, line, "hash_ids", f"expected a list of integers, got {ids!r:.80}")
    for position, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(
                path, line, "hash_ids", f"item {position} must be an integer >= 0, got {value!r}"
            )
    expected = -(-input_tokens // block_tokens)
    if len(ids) != expected:
        raise _fail(
            path,
            line,
            "hash_ids",
            f"has {len(ids)} ids; {input_tokens} input tokens in {block_tokens}-token blocks "
            f"need ceil({input_tokens}/{block_tokens}) = {expected}",
        )
    return ids


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from None
    with handle:
        for line_number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                yield line_number, json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{line_number}: not valid JSON: {exc.msg}") from None


def load_mooncake(path: str | Path, name: str | None = None) -> Trace:
    """Read a Mooncake FAST'25 trace (``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids`` of 512-token blocks).

    Raises:
        TraceError: naming the file, line and field of the first bad row.
    """
    path = Path(path)
    where = str(path)
    requests: list[TraceRequest] = []
    for line, row in _json_lines(path):
        if not isinstance(row, dict):
            raise TraceError(f"{where}:{line}: expected a JSON object, got {type(row).__name__}")
        timestamp_ms = _number_field(row, "timestamp", where, line)
        input_tokens = _int_field(row, "input_length", where, line, 1)
        output_tokens = _int_field(row, "output_length", where, line, 1)
        ids = _hash_ids_field(row, where, line, input_tokens, MOONCAKE_BLOCK_TOKENS)
        requests.append(
            TraceRequest(
                index=len(requests),
                arrival_s=timestamp_ms / 1000.0,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                hash_ids=ids,
                line=line,
            )
        )
    if not requests:
        raise TraceError(f"{where}: the trace has no requests")
    return Trace(name or path.stem, MOONCAKE_BLOCK_TOKENS, renumber_by_arrival(requests), where)


class _TextBlockIds:
    """Chained ids for token blocks of text prompts: equal prefixes get equal ids."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[int, int] = {}

    def ids(self, tokens: Sequence[int]) -> list[int]:
        from array import array

        result = []
        parent = 0
        size = self.block_tokens
        for start in range(0, len(tokens), size):
            chunk = array("I", tokens[start : start + size]).tobytes()
            parent = xxhash.xxh3_64_intdigest(chunk, seed=parent)
            result.append(self._ids.setdefault(parent, len(self._ids)))
        return result


def load_kv_picker_jsonl(path: str | Path, name: str | None = None) -> Trace:
    """Read a trace in kv-picker's own JSONL format (see the module docstring).

    Raises:
        TraceError: naming the file, line and field of the first bad row.
    """
    from kv_picker_bench.sim.tokenizer import encode

    path = Path(path)
    where = str(path)
    block_tokens = DEFAULT_BLOCK_TOKENS
    trace_name = name or path.stem
    requests: list[TraceRequest] = []
    text_ids: _TextBlockIds | None = None
    for line, row in _json_lines(path):
        if not isinstance(row, dict):
            raise TraceError(f"{where}:{line}: expected a JSON object, got {type(row).__name__}")
        if "kv_picker_trace" in row:
            if requests:
                raise TraceError(f"{where}:{line}: the header must be the first line")
            version = row["kv_picker_trace"]
            if version != KV_PICKER_TRACE_VERSION:
                raise _fail(where, line, "kv_picker_trace", f"unsupported version {version!r}")
            block_tokens = _int_field(row, "block_tokens", where, line, 1)
            if "name" in row and name is None:
                if not isinstance(row["name"], str):
                    raise _fail(where, line, "name", "expected a string")
                trace_name = row["name"]
            continue
        known = {
            "arrival_s",
            "input_tokens",
            "output_tokens",
            "hash_ids",
            "prompt",
            "session",
            "output_hash_ids",
            "lora",
            "cache_salt",
        }
        unknown = sorted(set(row) - known)
        if unknown:
            raise _fail(
                where, line, unknown[0], f"unknown field; known: {', '.join(sorted(known))}"
            )
        arrival_s = _number_field(row, "arrival_s", where, line)
        output_tokens = _int_field(row, "output_tokens", where, line, 1)
        session = row.get("session")
        if session is not None and not isinstance(session, str):
            raise _fail(where, line, "session", f"expected a string, got {session!r}")
        lora = _name_field(row, "lora", where, line)
        salt = _name_field(row, "cache_salt", where, line)
        prompt = row.get("prompt")
        if prompt is not None:
            if "hash_ids" in row:
                raise _fail(where, line, "prompt", "give either prompt or hash_ids, not both")
            if not isinstance(prompt, str) or not prompt:
                raise _fail(where, line, "prompt", "expected a non-empty string")
            tokens = encode(prompt)
            if "input_tokens" in row:
                given = _int_field(row, "input_tokens", where, line, 1)
                if given != len(tokens):
                    raise _fail(
                        where,
                        line,
                        "input_tokens",
                        f"{given} does not match the prompt's {len(tokens)} tokens",
                    )
            if text_ids is None:
                text_ids = _TextBlockIds(block_tokens)
            ids = text_ids.ids(tokens)
            input_tokens = len(tokens)
        else:
            input_tokens = _int_field(row, "input_tokens", where, line, 1)
            ids = _hash_ids_field(row, where, line, input_tokens, block_tokens)
        output_ids = None
        if "output_hash_ids" in row:
            output_ids = _hash_ids_field(
                {"hash_ids": row["output_hash_ids"]},
                where,
                line,
                input_tokens + output_tokens,
                block_tokens,
            )
        requests.append(
            TraceRequest(
                index=len(requests),
                arrival_s=arrival_s,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                hash_ids=ids,
                session=session,
                prompt=prompt,
                line=line,
                output_ids=output_ids,
                lora=lora,
                salt=salt,
            )
        )
    if not requests:
        raise TraceError(f"{where}: the trace has no requests")
    namespaced = any(r.namespaced for r in requests)
    if namespaced:  # before text ids are moved above the given ones
        _check_content_ids([r for r in requests if r.prompt is None], where)
    if text_ids is not None and any(r.prompt is None for r in requests):
        # Text ids are dense from 0 and could collide with given ids: move them apart.
        offset = 1 + max(i for r in requests if r.prompt is None for i in r.hash_ids)
        for request in requests:
            if request.prompt is not None:
                request.hash_ids = [i + offset for i in request.hash_ids]
    if namespaced:
        _check_content_ids(requests, where)
        _apply_namespaces(requests)
    return Trace(trace_name, block_tokens, renumber_by_arrival(requests), where)


def _name_field(row: dict[str, Any], key: str, path: str, line: int) -> str | None:
    value = row.get(key)
    if value is not None and not (isinstance(value, str) and value):
        raise _fail(path, line, key, f"expected a non-empty string, got {value!r}")
    return value


def _check_content_ids(requests: Sequence[TraceRequest], path: str) -> None:
    """In a trace with adapters or salts every id must name content (below 2**40), or a plain
    id could equal a namespaced one."""
    for request in requests:
        field_name = "prompt" if request.prompt is not None else "hash_ids"
        for key, ids in ((field_name, request.hash_ids), ("output_hash_ids", request.output_ids)):
            if ids and max(ids) >= CONTENT_ID_LIMIT:
                raise _fail(
                    path,
                    request.line,
                    key,
                    f"ids must be below 2**40 in a trace that uses lora or cache_salt, "
                    f"got {max(ids)}",
                )


def _apply_namespaces(requests: Sequence[TraceRequest]) -> None:
    """Moves the ids of requests with an adapter or a salt into their cache namespaces."""
    namespaces = CacheNamespaces()
    for request in requests:
        if request.namespaced:
            request.hash_ids = namespaces.apply(request.hash_ids, request.lora, request.salt)
            if request.output_ids is not None:
                request.output_ids = namespaces.apply(
                    request.output_ids, request.lora, request.salt
                )


def write_kv_picker_jsonl(trace: Trace, path: str | Path) -> None:
    """Write a trace in kv-picker's JSONL format (ids, not text, for generated prompts).

    Ids are written as content ids, with the adapter and salt beside them, as the reader
    expects (see the module docstring).
    """
    with Path(path).open("w", encoding="utf-8") as handle:
        header = {
            "kv_picker_trace": KV_PICKER_TRACE_VERSION,
            "block_tokens": trace.block_tokens,
            "name": trace.name,
        }
        handle.write(json.dumps(header) + "\n")
        for request in trace.requests:
            row: dict[str, Any] = {
                "arrival_s": round(request.arrival_s, 6),
                "input_tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
                "hash_ids": request.content_ids,
            }
            if request.session is not None:
                row["session"] = request.session
            if request.output_ids is not None:
                row["output_hash_ids"] = request.output_content_ids
            if request.lora is not None:
                row["lora"] = request.lora
            if request.salt is not None:
                row["cache_salt"] = request.salt
            handle.write(json.dumps(row) + "\n")


def load_trace(path: str | Path, fmt: str = "auto", name: str | None = None) -> Trace:
    """Read a trace file, detecting the format from its first line when ``fmt`` is ``auto``.

    Args:
        path: The JSONL file.
        fmt: ``auto``, ``mooncake`` or ``kv-picker``.
        name: Name for reports (default: the file's stem).

    Raises:
        TraceError: unreadable file, unknown format, or a bad row.
    """
    if fmt == "mooncake":
        return load_mooncake(path, name)
    if fmt == "kv-picker":
        return load_kv_picker_jsonl(path, name)
    if fmt != "auto":
        raise TraceError(f"unknown trace format {fmt!r}; known: auto, mooncake, kv-picker")
    for _, row in _json_lines(Path(path)):
        if isinstance(row, dict) and "timestamp" in row and "input_length" in row:
            return load_mooncake(path, name)
        return load_kv_picker_jsonl(path, name)
    raise TraceError(f"{path}: the trace has no requests")


def parse_trace_spec(spec: str) -> Trace:
    """A trace from a file path or a generator spec such as
    ``shared-prefix:groups=150,users=5,context=6000,question=1200,output=1000,rate=20`` or
    ``rag:seed=3,top_k=4``.

    Generators are the workload families (:data:`FAMILIES`; ``seed=N`` draws their ranged
    parameters, see :mod:`~kv_picker_bench.harness.families`) and ``llm-d``, the shared-prefix
    generator with llm-d's published parameters and load ladder (override any of them, e.g.
    ``llm-d:stages=10x60``).

    Raises:
        TraceError: an unknown generator or parameter, a bad value, or a bad trace file.
    """
    name, sep, params_text = spec.partition(":")
    if name not in GENERATORS:
        if Path(spec).exists() or not sep:
            return load_trace(spec)
        raise TraceError(
            f"{spec!r}: not a file and not a generator; generators: {', '.join(GENERATORS)}"
        )
    trace = build_generator(name, params_text)
    trace.source = spec
    return trace


# ------------------------------------------------------------------ slicing and scaling


def slice_trace(
    trace: Trace,
    *,
    first: int | None = None,
    window_s: tuple[float, float] | None = None,
    load: float = 1.0,
) -> Trace:
    """A new trace: a time window (trace seconds), then the first N requests, then the
    arrival rate multiplied by ``load`` (timestamps divided by it), starting at 0.

    Raises:
        TraceError: nothing left, or a bad argument.
    """
    requests = trace.requests
    notes = list(trace.notes)
    if window_s is not None:
        start_s, end_s = window_s
        if end_s <= start_s:
            raise TraceError(f"window {start_s}:{end_s}: the end must be after the start")
        arrivals = [r.arrival_s for r in requests]
        lo = bisect.bisect_left(arrivals, start_s)
        hi = bisect.bisect_left(arrivals, end_s)
        requests = requests[lo:hi]
        notes.append(f"window {start_s:g}s..{end_s:g}s")
    if first is not None:
        if first < 1:
            raise TraceError("first must be >= 1")
        requests = requests[:first]
        notes.append(f"first {first}")
    if not (load > 0 and math.isfinite(load)):
        raise TraceError(f"load must be a positive number, got {load}")
    if not requests:
        raise TraceError(f"{trace.name}: no request left after slicing")
    origin_s = requests[0].arrival_s
    if load != 1.0:
        notes.append(f"load x{load:g}")
    sliced = [
        replace(request, index=index, arrival_s=(request.arrival_s - origin_s) / load)
        for index, request in enumerate(requests)
    ]
    return Trace(trace.name, trace.block_tokens, sliced, trace.source, notes)


def scale_rate(trace: Trace, factor: float) -> Trace:
    """A new trace whose arrival rate is ``factor`` times the original's: every arrival time
    divided by ``factor`` (the shape of the arrivals, bursts and think times included, is kept
    and compressed alike).

    Raises:
        TraceError: ``factor`` is not a positive finite number.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise TraceError(f"rate factor must be a positive number, got {factor}")
    scaled = [replace(request, arrival_s=request.arrival_s / factor) for request in trace.requests]
    notes = [*trace.notes, f"rate x{factor:g}"]
    return Trace(trace.name, trace.block_tokens, scaled, trace.source, notes)


def iter_ids(requests: Iterable[TraceRequest]) -> Iterator[int]:
    """Every block id of every request, in order (for statistics)."""
    for request in requests:
        yield from request.hash_ids
