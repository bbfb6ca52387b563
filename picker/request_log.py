"""The request log: a replayable trace of what the picker routed, for tuning on real traffic.

Routing profiles are tuned offline (``kv-picker bench replay``), and the traffic that matters
is the deployment's own. With a ``requestLog`` section the picker writes one Mooncake JSONL row
per routed request, a file the harness replays as it is, and nothing a prompt could be read
back from::

    {"timestamp": 1520, "input_length": 2348, "output_length": 16, "hash_ids": [8160..., ...]}

- ``timestamp``: milliseconds from the start of the log to the request's arrival (its body
  parsed by the director).
- ``input_length``: prompt tokens; exact when a tokenizer ran (the precise scorer publishes
  :data:`~kv_picker.scheduling.signals.PROMPT_TOKENS`) or the prompt came as token ids, else
  the prompt's characters / 4, rounded up.
- ``output_length``: the completion tokens of the response's usage. A response without usage
  (a stream without ``stream_options.include_usage``, a failed request) gets the mean of the
  outputs reported so far (1 before any), so a replay's decode work stays about right.
- ``hash_ids``: one id per ``blockTokens`` block of the prompt, a trailing partial block
  included, as in Mooncake traces.

Block ids::

    root  = chain_root(model or adapter, cache_salt)            kv_picker.state.hashing
    key_i = chain_keys(block i, parent=key_{i-1})               a partial last block: one more
    id_i  = BLAKE2b-64(key=salt, le64(key_i)) >> 11             53 bits, exact in any JSON reader

    block i: token ids (a completion sent as ids): 4 * blockTokens bytes of uint32 tokens;
             else the prompt's UTF-8 text: 4 * blockTokens bytes, 4 characters per token as the
             approximate prefix scorer assumes (one token per 4-character word is exact)

The picker's one chained hasher makes an id name its block and everything before it, so equal
prefixes give equal leading ids, and its root keeps tenants (model or adapter, ``cache_salt``)
apart. The keyed BLAKE2b step is what makes the file safe to hand out: an xxh3 seed is not a
secret key, but without the salt nobody can compute the id of a guessed prompt, and logs of
deployments with different salts share no ids. When the exact token count and the text's blocks
disagree (a tokenizer's count is not characters / 4), the keys are cut, or extended with chained
filler keys, to ``ceil(input_length / blockTokens)``, which the format requires.

The work is split so that a request pays a few microseconds:

```
Director.parse   arrival stamp in the request's state
Director.route   encode + chained keys -> LoggedRequest (frozen; the prompt is dropped next)
finish()         (record, output tokens) appended to a bounded deque; when it is full the row
                 is dropped and counted (kv_picker_request_log_dropped_total), never waited on
writer thread    every second, or when the deque is half full: salt, format, write, rotate
```

Files rotate by size (``path``, ``path.1`` ... ``path.<backups>``) and share one origin, so
``cat path.2 path.1 path`` is one trace. Rows are written as requests finish, in completion
order; the harness's loader sorts them by timestamp. A restart moves the previous file aside
and begins a new origin (and new ids, unless ``salt`` is set).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kv_picker.config import RequestLogConfig
from kv_picker.errors import ConfigError
from kv_picker.request import LLMRequest
from kv_picker.scheduling.signals import DEFAULT_CHARS_PER_TOKEN, PROMPT_TOKENS
from kv_picker.state.hashing import TOKEN_BYTES, chain_keys, chain_root, token_bytes

log = logging.getLogger(__name__)

ARRIVAL_STATE = "request_log.arrival_s"
"""``LLMRequest.state`` key: the log's clock when the director parsed the request."""

DEFAULT_CAPACITY = 16_384
"""Finished rows waiting for the writer before new ones are dropped."""

_CHARS_PER_TOKEN = int(DEFAULT_CHARS_PER_TOKEN)
# Keyed ids of recent keys: shared prefixes (system prompts, conversations) repeat their
# leading keys on most rows, and one BLAKE2b call costs ten dict lookups. About 7 MiB when full.
_ID_CACHE_ENTRIES = 1 << 16
_ID_SHIFT = 64 - 53
_KEY_PERSON = b"kv-picker/log"
_FINGERPRINT_PERSON = b"kv-picker/log-fp"
# Stands for tokens a tokenizer counted beyond the text's blocks: chained like a block, so
# equal prompts still get equal ids.
_FILLER_BLOCK = b"\0kv-picker/log filler block\0"


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """What the pick keeps of a request for its row: no text, only numbers.

    Attributes:
        timestamp_ms: arrival, in milliseconds from the start of the log.
        input_tokens: prompt tokens (exact or estimated; see the module docstring).
        block_keys: the chained keys, one per block; salted only when written.
    """

    timestamp_ms: int
    input_tokens: int
    block_keys: Sequence[int]


def _salt_key(salt: bytes | str) -> bytes:
    # A fixed-size BLAKE2b key from a salt of any length.
    data = salt.encode() if isinstance(salt, str) else salt
    return hashlib.blake2b(data, digest_size=32, person=_KEY_PERSON).digest()


def salt_fingerprint(salt: bytes | str) -> str:
    """A short public name of a salt: equal fingerprints mean equal ids, and it reveals
    nothing that would let someone compute ids."""
    return hashlib.blake2b(_salt_key(salt), digest_size=8, person=_FINGERPRINT_PERSON).hexdigest()


class RequestLog:
    """Writes a Mooncake trace of the routed requests (see the module docstring).

    Args:
        path: the newest file; older ones are ``path.1`` ... ``path.<backups>``.
        max_bytes: rotate before a file would grow beyond this.
        backups: rotated files kept (0: the file is truncated when full).
        salt: the secret the ids are keyed with (a ``str`` is UTF-8 encoded); None draws a
            random one, so the ids of this process match no one else's.
        block_tokens: tokens per block id.
        clock: monotonic seconds (arrival stamps and the log's origin).
        registry: where ``kv_picker_request_log_*`` metrics are exported, if anywhere.
        capacity: finished rows waiting for the writer before new ones are dropped.
        flush_interval_s: how often the writer wakes up when the queue is not filling.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 64 * 1024 * 1024,
        backups: int = 3,
        salt: bytes | str | None = None,
        block_tokens: int = 512,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        capacity: int = DEFAULT_CAPACITY,
        flush_interval_s: float = 1.0,
    ) -> None:
        if max_bytes < 1 or backups < 0 or block_tokens < 1 or capacity < 1:
            raise ValueError("max_bytes, block_tokens and capacity must be >= 1, backups >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.flush_interval_s = flush_interval_s
        self.salt_is_random = salt is None
        if salt is None:
            salt = secrets.token_bytes(32)
        self.fingerprint = salt_fingerprint(salt)
        # Keying happens once; each id copies the keyed state (cheaper than re-keying).
        self._keyed = hashlib.blake2b(key=_salt_key(salt), digest_size=8)
        self._ids: dict[int, int] = {}
        self._clock = clock
        self._origin_s = clock()
        self._text_block_bytes = _CHARS_PER_TOKEN * block_tokens
        self._token_block_bytes = TOKEN_BYTES * block_tokens
        # deque append and popleft are atomic: the event loop appends, the writer pops.
        self._queue: deque[tuple[LoggedRequest, int | None]] = deque()
        self._wake_at = max(1, capacity // 2)
        self.num_written = 0
        self.num_dropped_full = 0
        self.num_dropped_errors = 0
        self._failing = False
        self._output_sum = 0
        self._output_count = 0
        self._file: BinaryIO | None = None
        self._size_bytes = 0
        self._open_for_writing = False  # from start() to close()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        if registry is not None:
            registry.register(_RequestLogMetrics(self))

    @classmethod
    def from_config(
        cls,
        config: RequestLogConfig,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> RequestLog:
        """The log a ``requestLog`` section describes."""
        return cls(
            config.path,
            max_bytes=config.max_bytes,
            backups=config.backups,
            salt=config.salt,
            block_tokens=config.block_tokens,
            clock=clock,
            registry=registry,
        )

    # -- the request's side (event loop) ----------------------------------------------------

    def arrived(self, request: LLMRequest) -> None:
        """Stamp the request's arrival (the director calls this once the body is parsed)."""
        request.state[ARRIVAL_STATE] = self._clock()

    def record(self, request: LLMRequest) -> LoggedRequest | None:
        """What the request's row needs, taken before the pick drops its prompt.

        Returns None for a prompt without tokens (nothing to replay). Never raises: a request
        the log cannot describe is routed all the same, and the failure logged.
        """
        try:
            return self._record(request)
        except Exception:
            log.exception("request %s: request log record failed", request.request_id)
            return None

    def _record(self, request: LLMRequest) -> LoggedRequest | None:
        state = request.state
        arrival_s = state.get(ARRIVAL_STATE)
        if arrival_s is None:  # routed without Director.parse (tests, tools)
            arrival_s = self._clock()
        token_ids = request.prompt.token_ids
        data = None if token_ids is None else _token_bytes(token_ids)
        if data is not None:
            input_tokens = len(data) // TOKEN_BYTES
            block_bytes = self._token_block_bytes
        else:
            text = request.prompt.text
            data = text.encode()
            exact = state.get(PROMPT_TOKENS)
            if isinstance(exact, int | float) and exact >= 1:
                input_tokens = int(exact)
            else:
                input_tokens = -(-len(text) // _CHARS_PER_TOKEN)
            block_bytes = self._text_block_bytes
        if input_tokens < 1:
            return None
        parent = chain_root(request.target_model, request.lora_adapter, request.cache_salt)
        keys = chain_keys(data, parent, block_bytes)
        if keys:
            parent = keys[-1]
        tail_bytes = len(data) - len(keys) * block_bytes
        if tail_bytes:
            parent = chain_keys(data[-tail_bytes:], parent, tail_bytes)[0]
            keys.append(parent)
        num_blocks = -(-input_tokens // self.block_tokens)
        if len(keys) > num_blocks:
            del keys[num_blocks:]
        while len(keys) < num_blocks:
            parent = chain_keys(_FILLER_BLOCK, parent, len(_FILLER_BLOCK))[0]
            keys.append(parent)
        timestamp_ms = round((arrival_s - self._origin_s) * 1000.0)
        return LoggedRequest(max(0, timestamp_ms), input_tokens, keys)

    def finish(self, logged: LoggedRequest, output_tokens: int | None) -> None:
        """Queue a finished request's row; when the queue is full, drop it and count it.

        Args:
            logged: what :meth:`record` kept at the pick.
            output_tokens: the completion tokens the endpoint reported, None when unknown.
        """
        queue = self._queue
        if len(queue) >= self.capacity:
            self.num_dropped_full += 1
            return
        queue.append((logged, output_tokens))
        if len(queue) == self._wake_at:  # a burst: write before the interval ends
            self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Open a fresh file (the previous one rotated aside) and start the writer thread.

        Raises:
            ConfigError: the file cannot be opened.
        """
        if self._thread is not None:
            raise RuntimeError("the request log is already running")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and self.path.stat().st_size > 0:
                self._rotate()  # a file per run: timestamps and ids restart
            else:
                self._open()
        except OSError as exc:
            raise ConfigError(
                f"requestLog.path: cannot open {self.path}: {exc.strerror or exc}"
            ) from exc
        self._open_for_writing = True
        self._origin_s = self._clock()
        self._thread = threading.Thread(target=self._run, name="kv-picker-request-log", daemon=True)
        self._thread.start()
        log.info(
            "request log: writing %s (rotating at %d bytes, %d backups, %d-token blocks); "
            "salt fingerprint %s%s",
            self.path,
            self.max_bytes,
            self.backups,
            self.block_tokens,
            self.fingerprint,
            " (random: set requestLog.salt to share ids across replicas)"
            if self.salt_is_random
            else "",
        )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the writer, write what is queued, close the file (blocking; idempotent)."""
        thread = self._thread
        if thread is not None:
            self._stopping.set()
            self._wake.set()
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("request log: the writer did not stop within %.1fs", timeout_s)
                return
            self._thread = None
        self.flush()
        with self._write_lock:
            self._open_for_writing = False
            if self._file is not None:
                self._file.close()
                self._file = None

    @property
    def running(self) -> bool:
        """The writer thread is running."""
        return self._thread is not None

    @property
    def num_queued(self) -> int:
        """Finished rows waiting for the writer."""
        return len(self._queue)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    # -- the writer's side ------------------------------------------------------------------

    def flush(self) -> None:
        """Write every queued row now (the writer does this on its own; safe from any
        thread)."""
        with self._write_lock:
            queue = self._queue
            rows: list[bytes] = []
            while queue:
                logged, output_tokens = queue.popleft()
                rows.append(self._row(logged, output_tokens))
            if not rows:
                return
            if not self._open_for_writing:  # never started, or closed
                self.num_dropped_errors += len(rows)
                return
            written = self.num_written
            try:
                self._write(rows)
            except OSError as exc:
                self.num_dropped_errors += len(rows) - (self.num_written - written)
                if not self._failing:
                    self._failing = True
                    log.error(
                        "request log: cannot write %s (%s); dropping rows until it can",
                        self.path,
                        exc.strerror or exc,
                    )
                return
            if self._failing:
                self._failing = False
                log.info("request log: writing %s again", self.path)

    def hash_ids(self, logged: LoggedRequest) -> list[int]:
        """The ids a row carries: each chained key keyed with the salt, cut to 53 bits."""
        known = self._ids
        ids = []
        for key in logged.block_keys:
            block_id = known.get(key)
            if block_id is None:
                hasher = self._keyed.copy()
                hasher.update(key.to_bytes(8, "little"))
                block_id = int.from_bytes(hasher.digest(), "little") >> _ID_SHIFT
                if len(known) >= _ID_CACHE_ENTRIES:
                    known.clear()  # cheaper than tracking recency, and rare
                known[key] = block_id
            ids.append(block_id)
        return ids

    def _row(self, logged: LoggedRequest, output_tokens: int | None) -> bytes:
        if output_tokens is not None and output_tokens >= 0:
            self._output_sum += output_tokens
            self._output_count += 1
        else:
            count = self._output_count
            output_tokens = round(self._output_sum / count) if count else 1
        ids = ", ".join(map(str, self.hash_ids(logged)))
        # The Mooncake files' own layout (json.dumps' default separators), without json.dumps.
        return (
            f'{{"timestamp": {logged.timestamp_ms}, "input_length": {logged.input_tokens}, '
            f'"output_length": {max(1, output_tokens)}, "hash_ids": [{ids}]}}\n'
        ).encode()

    def _write(self, rows: list[bytes]) -> None:
        # Rows go out in chunks that fit the current file; a row larger than max_bytes gets a
        # file of its own rather than being split or lost.
        chunk: list[bytes] = []
        chunk_bytes = 0
        for row in rows:
            if self._size_bytes + chunk_bytes + len(row) > self.max_bytes and (
                chunk or self._size_bytes
            ):
                self._append(chunk, chunk_bytes)
                chunk, chunk_bytes = [], 0
                self._rotate()
            chunk.append(row)
            chunk_bytes += len(row)
        self._append(chunk, chunk_bytes)

    def _append(self, chunk: list[bytes], chunk_bytes: int) -> None:
        if not chunk:
            return
        # No file: a rotation could not open the new one; try again.
        file = self._file if self._file is not None else self._open()
        file.write(b"".join(chunk))
        file.flush()
        self._size_bytes += chunk_bytes
        self.num_written += len(chunk)

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        path = str(self.path)
        for index in range(self.backups, 0, -1):
            older = f"{path}.{index - 1}" if index > 1 else path
            if os.path.exists(older):
                os.replace(older, f"{path}.{index}")
        self._open()

    def _open(self) -> BinaryIO:
        # "wb": with no backups, rotating truncates the one file.
        file = self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close or _rotate)
        self._size_bytes = 0
        return file


def _token_bytes(token_ids: Sequence[int]) -> bytes | None:
    try:
        return token_bytes(token_ids)
    except (OverflowError, TypeError):  # ids a client sent that are not uint32: use the text
        return None


class _RequestLogMetrics:
    """``kv_picker_request_log_*``, read from the log's counters on every scrape (no lock is
    taken on the request path)."""

    def __init__(self, request_log: RequestLog) -> None:
        self._log = request_log

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        request_log = self._log
        written = CounterMetricFamily(
            "kv_picker_request_log_rows", "Rows written to the request log."
        )
        written.add_metric((), request_log.num_written)
        yield written
        dropped = CounterMetricFamily(
            "kv_picker_request_log_dropped",
            "Rows of the request log not written, by reason (queue-full: the writer fell "
            "behind; write-error: the file could not be written).",
            labels=("reason",),
        )
        dropped.add_metric(("queue-full",), request_log.num_dropped_full)
        dropped.add_metric(("write-error",), request_log.num_dropped_errors)
        yield dropped
        queued = GaugeMetricFamily(
            "kv_picker_request_log_queued_rows", "Finished rows waiting for the writer."
        )
        queued.add_metric((), request_log.num_queued)
        yield queued
