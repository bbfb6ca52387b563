"""The request log: its rows load as a Mooncake trace, carry no text, chain and salt their ids,
rotate within bounds, drop instead of blocking, and stay off unless configured."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.app import PickerApp
from kv_picker.config import RequestLogConfig, load_config, parse_config
from kv_picker.director import Director
from kv_picker.errors import ConfigError
from kv_picker.handlers.extproc import RequestStream
from kv_picker.plugins import builtin_registry
from kv_picker.request import LLMRequest, Prompt
from kv_picker.request_log import ARRIVAL_STATE, RequestLog, salt_fingerprint
from kv_picker.scheduling.signals import PROMPT_TOKENS
from kv_picker.state.hashing import chain_root
from kv_picker_bench.harness.traces import load_mooncake, load_trace
from tests.fakes import ManualClock, make_director, make_request
from tests.picker.handlers.test_extproc_stream import body_message, headers_message, run

REGISTRY = builtin_registry(include_entry_points=False)
BLOCK_CHARS = 4 * 512
WRITER_THREAD = "kv-picker-request-log"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(tag: str, count: int) -> str:
    """``count`` pseudo-random words of four characters (" abc"), fixed by ``tag``: one token
    each for the simulated endpoint's tokenizer, 512 of them to a block."""
    out = []
    for i in range(count):
        h = xxhash.xxh32_intdigest(f"{tag}/{i}".encode())
        out.append(" " + LETTERS[h % 26] + LETTERS[h // 26 % 26] + LETTERS[h // 676 % 26])
    return "".join(out)


def new_log(tmp_path: Path, name: str = "requests.jsonl", **kwargs: Any) -> RequestLog:
    kwargs.setdefault("salt", "test-salt")
    kwargs.setdefault("clock", ManualClock())
    return RequestLog(tmp_path / name, **kwargs)


def ids_of(request_log: RequestLog, *requests: LLMRequest) -> list[list[int]]:
    """The hash ids the log writes for each request, in order."""
    rows = []
    for request in requests:
        logged = request_log.record(request)
        assert logged is not None
        rows.append(request_log.hash_ids(logged))
    return rows


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_director(request_log: RequestLog) -> Director:
    director = make_director()
    director.request_log = request_log
    return director


def completion(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


# -- the format -------------------------------------------------------------------------------


def test_rows_load_with_the_harness_mooncake_reader(tmp_path: Path) -> None:
    clock = ManualClock()
    request_log = new_log(tmp_path, clock=clock)
    director = logged_director(request_log)
    request_log.start()
    prompts = [words("ctx", 1100) + words(f"q{i}", 100 * i + 1) for i in range(4)]
    handles = []
    for prompt in prompts:
        clock.advance(0.25)
        request = director.parse(completion(prompt), {})
        clock.advance(0.010)  # tokenizing, scheduling: the arrival is what counts
        handles.append(director.route(request))
    for i, handle in enumerate(reversed(handles)):  # finished in reverse order
        handle.finish(output_tokens=20 + i)
    request_log.close()

    path = tmp_path / "requests.jsonl"
    rows = rows_of(path)
    assert [sorted(row) for row in rows] == [
        ["hash_ids", "input_length", "output_length", "timestamp"]
    ] * 4
    trace = load_mooncake(path)
    assert load_trace(path).summary() == trace.summary()  # detected as Mooncake
    # Each arrival is the parse, not the pick 10 ms later.
    assert [r.arrival_s for r in trace.requests] == [0.25, 0.51, 0.77, 1.03]
    assert [r.input_tokens for r in trace.requests] == [len(p) // 4 for p in prompts]
    assert [r.output_tokens for r in trace.requests] == [23, 22, 21, 20]
    for request in trace.requests:
        assert len(request.hash_ids) == -(-request.input_tokens // 512)
        assert all(0 <= i < 2**53 for i in request.hash_ids)


def test_no_prompt_text_reaches_the_file(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    director = logged_director(request_log)
    request_log.start()
    secret_words = ["zanzibar", "quokka", "marmalade", "Platypus"]
    for i in range(3):
        prompt = " ".join(secret_words * 200) + f" user{i} " * 50
        director.route(director.parse(completion(prompt), {})).finish(output_tokens=5)
    request_log.close()
    text = (tmp_path / "requests.jsonl").read_text()
    assert text.count("\n") == 3
    for word in [*secret_words, "user"]:
        assert word.lower() not in text.lower()
    # Nothing but the four keys and integers.
    assert re.fullmatch(
        r'(\{"timestamp": \d+, "input_length": \d+, "output_length": \d+, '
        r'"hash_ids": \[\d+(, \d+)*\]\}\n)+',
        text,
    )


def reference_ids(text: str, salt: str, model: str = "m", cache_salt: str | None = None) -> list:
    """The documented scheme, computed independently of the module."""
    data = text.encode()
    key = hashlib.blake2b(salt.encode(), digest_size=32, person=b"kv-picker/log").digest()
    parent = chain_root(model, None, cache_salt)
    ids = []
    for start in range(0, len(data), BLOCK_CHARS):
        parent = xxhash.xxh3_64_intdigest(data[start : start + BLOCK_CHARS], seed=parent)
        digest = hashlib.blake2b(parent.to_bytes(8, "little"), key=key, digest_size=8).digest()
        ids.append(int.from_bytes(digest, "little") >> 11)
    return ids


def test_ids_follow_the_documented_scheme(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    text = words("abc", 1500)  # 2 full blocks and a partial one
    (ids,) = ids_of(request_log, make_request(text))
    assert ids == reference_ids(text, "test-salt")
    (salted,) = ids_of(request_log, make_request(text, cache_salt="tenant"))
    assert salted == reference_ids(text, "test-salt", cache_salt="tenant")


# -- the ids ----------------------------------------------------------------------------------


def test_equal_prefixes_give_equal_leading_ids(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    context = words("ctx", 3 * 512)  # exactly three blocks
    a, b, c, short = ids_of(
        request_log,
        make_request(context + words("qa", 700)),
        make_request(context + words("qb", 700)),
        make_request(context + words("qa", 700)),
        make_request(context + words("qa", 100)),
    )
    assert a[:3] == b[:3] and a[3:] != b[3:] and not set(a[3:]) & set(b[3:])
    assert a == c  # the same prompt, the same ids
    # A prompt whose last block is partial shares the full blocks before it only.
    assert short[:3] == a[:3] and short[3] != a[3]
    # The chain: an equal block after a different one gets a different id.
    x, y = ids_of(
        request_log,
        make_request(words("xx", 512) + context),
        make_request(words("yy", 512) + context),
    )
    assert not set(x) & set(y)


def test_different_salts_give_disjoint_ids(tmp_path: Path) -> None:
    prompts = [make_request(words("ctx", 2048) + words(f"q{i}", 300)) for i in range(5)]
    first = ids_of(new_log(tmp_path, salt="deployment-a"), *prompts)
    again = ids_of(new_log(tmp_path, salt="deployment-a"), *prompts)
    other = ids_of(new_log(tmp_path, salt="deployment-b"), *prompts)
    random_1 = new_log(tmp_path, salt=None)
    random_2 = new_log(tmp_path, salt=None)
    assert first == again
    ids = {i for row in first for i in row}
    assert len(ids) == 4 + 5  # the shared context's blocks, then one per question
    assert not ids & {i for row in other for i in row}
    assert not ids & {i for row in ids_of(random_1, *prompts) for i in row}
    assert not {i for row in ids_of(random_1, *prompts) for i in row} & {
        i for row in ids_of(random_2, *prompts) for i in row
    }
    assert random_1.fingerprint != random_2.fingerprint
    assert new_log(tmp_path, salt="deployment-a").fingerprint == salt_fingerprint("deployment-a")


def test_the_salt_is_logged_as_a_fingerprint_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kv_picker.request_log")
    configured = new_log(tmp_path, salt="a-secret-salt")
    configured.start()
    configured.close()
    assert salt_fingerprint("a-secret-salt") in caplog.text
    assert "a-secret-salt" not in caplog.text
    caplog.clear()
    drawn = new_log(tmp_path, name="other.jsonl", salt=None)
    drawn.start()
    drawn.close()
    assert drawn.fingerprint in caplog.text and "random" in caplog.text


def test_tenants_never_share_ids(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    text = words("ctx", 2048)
    rows = ids_of(
        request_log,
        make_request(text),
        make_request(text, cache_salt="tenant-1"),
        make_request(text, cache_salt="tenant-2"),
        make_request(text, model="other-model"),
        make_request(text, lora_adapter="sql-lora"),
    )
    seen: set[int] = set()
    for row in rows:
        assert not seen & set(row)
        seen |= set(row)


def token_request(token_ids: tuple[int, ...], text: str = "") -> LLMRequest:
    """A completion sent as token ids."""
    return LLMRequest(
        "r1", "m", "m", "/v1/completions", Prompt("completions", text, token_ids=token_ids)
    )


def test_token_ids_are_cut_in_token_blocks(tmp_path: Path) -> None:
    request_log = new_log(tmp_path, block_tokens=16)
    shared = tuple(range(1000, 1048))  # three blocks
    a, b = token_request((*shared, 1, 2)), token_request((*shared, 7))
    logged = request_log.record(a)
    assert logged is not None and logged.input_tokens == 50
    ids_a, ids_b = ids_of(request_log, a, b)
    assert len(ids_a) == len(ids_b) == 4
    assert ids_a[:3] == ids_b[:3] and ids_a[3] != ids_b[3]
    # Ids that are not uint32 fall back to the text.
    logged = request_log.record(token_request((-1,), text="abcd" * 8))
    assert logged is not None and logged.input_tokens == 8 and len(logged.block_keys) == 1


@pytest.mark.parametrize("exact_tokens", [100, 1000, 1800, 5000])
def test_an_exact_token_count_fits_the_ids_to_it(tmp_path: Path, exact_tokens: int) -> None:
    request_log = new_log(tmp_path)
    text = words("ctx", 1800)  # 3.5 blocks of characters
    estimated = make_request(text)
    exact = make_request(text, state={PROMPT_TOKENS: exact_tokens})
    twin = make_request(text, state={PROMPT_TOKENS: exact_tokens})
    logged = request_log.record(exact)
    assert logged is not None and logged.input_tokens == exact_tokens
    by_chars, by_tokens, twin_ids = ids_of(request_log, estimated, exact, twin)
    assert len(by_chars) == 4
    assert len(by_tokens) == -(-exact_tokens // 512)
    shared = min(len(by_tokens), 3)  # the text's full blocks keep their ids
    assert by_tokens[:shared] == by_chars[:shared]
    assert by_tokens == twin_ids  # fillers are chained: equal prompts, equal ids
    assert len(set(by_tokens)) == len(by_tokens)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=120), st.text(max_size=60), st.text(max_size=60))
def test_ids_of_any_prompts_share_exactly_their_common_full_blocks(
    head: str, tail_a: str, tail_b: str
) -> None:
    request_log = RequestLog("unused.jsonl", salt="s", block_tokens=4)  # 16-byte blocks
    a, b = make_request(head + tail_a), make_request(head + tail_b)
    logged_a, logged_b = request_log.record(a), request_log.record(b)
    for text, logged in ((head + tail_a, logged_a), (head + tail_b, logged_b)):
        if not text:
            assert logged is None
            continue
        assert logged is not None
        assert logged.input_tokens == -(-len(text) // 4)
        assert len(logged.block_keys) == -(-logged.input_tokens // 4)
    if logged_a is None or logged_b is None:
        return
    data_a, data_b = (head + tail_a).encode(), (head + tail_b).encode()
    common = 0
    while common < min(len(data_a), len(data_b)) and data_a[common] == data_b[common]:
        common += 1
    full = common // 16
    keys_a, keys_b = list(logged_a.block_keys), list(logged_b.block_keys)
    text_blocks_a, text_blocks_b = -(-len(data_a) // 16), -(-len(data_b) // 16)
    shared = min(full, len(keys_a), len(keys_b))
    assert keys_a[:shared] == keys_b[:shared]
    # Past the common prefix the blocks differ, and so do their keys (text blocks only: the
    # ids of a multi-byte text are cut to its characters / 4).
    if data_a != data_b and full < min(len(keys_a), len(keys_b), text_blocks_a, text_blocks_b):
        assert keys_a[full] != keys_b[full]


# -- outputs and the handler ------------------------------------------------------------------


def test_output_without_usage_gets_the_mean_of_reported_ones(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    director = logged_director(request_log)
    request_log.start()
    for output_tokens in (None, 10, 20, None, 0):
        director.route(director.parse(completion(words("p", 600)), {})).finish(output_tokens)
    request_log.close()
    rows = rows_of(tmp_path / "requests.jsonl")
    # Before any report: 1; then mean(10, 20); a reported 0 is written as 1 (the format's
    # minimum) and counts in the mean.
    assert [row["output_length"] for row in rows] == [1, 10, 20, 15, 1]


def test_the_handler_hands_the_response_usage_to_the_log(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    director = logged_director(request_log)
    request_log.start()
    stream = RequestStream(director)
    run(stream, headers_message(), body_message(completion(words("p", 600), stream=True)))
    content_type = base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")
    run(
        stream,
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[content_type]))
        ),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(
                body=b'data: {"choices":[{"text":"a"}]}\n\n'
                b'data: {"choices":[],"usage":{"prompt_tokens":600,"completion_tokens":37}}\n\n'
                b"data: [DONE]\n\n",
                end_of_stream=True,
            )
        ),
    )
    # A stream that dies before any response: routed, so logged, without usage.
    dead = RequestStream(director)
    run(dead, headers_message(), body_message(completion(words("q", 600))))
    dead.close()
    request_log.close()
    rows = rows_of(tmp_path / "requests.jsonl")
    assert [(row["input_length"], row["output_length"]) for row in rows] == [(600, 37), (600, 37)]


def test_dry_runs_and_bodyless_requests_are_not_logged(tmp_path: Path) -> None:
    request_log = new_log(tmp_path)
    director = logged_director(request_log)
    request_log.start()
    director.route(director.parse(completion("abcd" * 100), {}), dry_run=True).finish()
    director.route_bodyless(None).finish()
    request_log.close()
    assert (tmp_path / "requests.jsonl").read_text() == ""


# -- the files --------------------------------------------------------------------------------


def test_rotation_bounds_the_files(tmp_path: Path) -> None:
    clock = ManualClock()
    request_log = new_log(tmp_path, clock=clock, max_bytes=400, backups=2)
    director = logged_director(request_log)
    request_log.start()
    for i in range(40):
        clock.advance(0.001)
        director.route(director.parse(completion(words(f"r{i}", 700)), {})).finish(i + 1)
        if i % 3 == 0:
            request_log.flush()
    request_log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"]
    for name in files:
        assert 0 < (tmp_path / name).stat().st_size <= 400
    kept = [
        row
        for name in ("requests.jsonl.2", "requests.jsonl.1", "requests.jsonl")
        for row in rows_of(tmp_path / name)
    ]
    # The newest rows, in order, with one origin across the files.
    outputs = [row["output_length"] for row in kept]
    assert outputs == list(range(41 - len(kept), 41))
    assert [row["timestamp"] for row in kept] == outputs
    assert request_log.num_written == 40


def test_without_backups_one_file_is_truncated(tmp_path: Path) -> None:
    request_log = new_log(tmp_path, max_bytes=250, backups=0)
    director = logged_director(request_log)
    request_log.start()
    for i in range(10):
        director.route(director.parse(completion(words("r", 700)), {})).finish(i + 1)
        request_log.flush()
    request_log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["requests.jsonl"]
    assert rows_of(tmp_path / "requests.jsonl")[-1]["output_length"] == 10


def test_a_row_larger_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    request_log = new_log(tmp_path, max_bytes=100, backups=5)
    director = logged_director(request_log)
    request_log.start()
    for i in range(3):
        director.route(director.parse(completion(words("r", 5000)), {})).finish(i + 1)
    request_log.close()
    for name in ("requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"):
        assert len(rows_of(tmp_path / name)) == 1


def test_a_restart_moves_the_previous_file_aside(tmp_path: Path) -> None:
    for run_index in range(2):
        request_log = new_log(tmp_path)
        director = logged_director(request_log)
        request_log.start()
        director.route(director.parse(completion("abcd" * 600), {})).finish(run_index + 1)
        request_log.close()
    assert rows_of(tmp_path / "requests.jsonl")[0]["output_length"] == 2
    assert rows_of(tmp_path / "requests.jsonl.1")[0]["output_length"] == 1


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_write_errors_drop_and_count_rows_until_the_file_takes_them_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kv_picker.request_log")
    request_log = new_log(tmp_path)
    director = logged_director(request_log)
    request_log.start()
    good_file = request_log._file
    request_log._file = FullDisk()  # type: ignore[assignment]
    for _ in range(3):
        director.route(director.parse(completion("abcd" * 600), {})).finish(1)
        request_log.flush()
    assert request_log.num_dropped_errors == 3
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    request_log._file = good_file
    director.route(director.parse(completion("abcd" * 600), {})).finish(1)
    request_log.close()
    assert len(rows_of(tmp_path / "requests.jsonl")) == 1
    assert request_log.num_written == 1 and request_log.num_dropped_errors == 3
    assert any("writing" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_an_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    request_log = RequestLog(tmp_path / "a-file" / "requests.jsonl")
    with pytest.raises(ConfigError, match=r"requestLog\.path: cannot open"):
        request_log.start()
    assert not request_log.running


# -- the queue --------------------------------------------------------------------------------


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    director = make_director()
    request_log = new_log(
        tmp_path, capacity=8, flush_interval_s=0.01, registry=director.metrics.registry
    )
    # The disk hangs: the writer takes one batch and blocks on it.
    release = threading.Event()
    writing = threading.Event()
    write = request_log._write

    def hanging_write(rows: list[bytes]) -> None:
        writing.set()
        release.wait(10)
        write(rows)

    request_log._write = hanging_write  # type: ignore[method-assign]
    request_log.start()
    logged = request_log.record(make_request(words("p", 600)))
    assert logged is not None
    request_log.finish(logged, 1)
    assert writing.wait(5)
    started = time.perf_counter()
    for _ in range(8 + 5):
        request_log.finish(logged, 1)
    elapsed_s = time.perf_counter() - started
    assert elapsed_s < 0.05  # never waited on the writer
    assert request_log.num_queued == 8
    exposition = director.metrics.exposition().decode()
    assert 'kv_picker_request_log_dropped_total{reason="queue-full"} 5.0' in exposition
    assert "kv_picker_request_log_queued_rows 8.0" in exposition
    release.set()
    request_log.close()
    assert len(rows_of(tmp_path / "requests.jsonl")) == 1 + 8
    exposition = director.metrics.exposition().decode()
    assert "kv_picker_request_log_rows_total 9.0" in exposition


# -- config and the service -------------------------------------------------------------------


def test_the_config_section_is_optional_with_defaults() -> None:
    assert parse_config({}, REGISTRY).request_log is None
    section = parse_config({"requestLog": {"path": "/tmp/r.jsonl", "salt": 42}}, REGISTRY)
    assert section.request_log == RequestLogConfig("/tmp/r.jsonl", 64 * 1024 * 1024, 3, "42", 512)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "requestLog.path: required"),
        ({"path": "r.jsonl", "maxBytes": 0}, "requestLog.maxBytes: must be >= 1"),
        ({"path": "r.jsonl", "backups": -1}, "requestLog.backups: must be >= 0"),
        ({"path": "r.jsonl", "salt": ""}, "requestLog.salt: must not be empty"),
        ({"path": "r.jsonl", "blockTokens": 0}, "requestLog.blockTokens: must be >= 1"),
        ({"path": "r.jsonl", "rotate": True}, "unknown field(s) rotate"),
    ],
)
def test_bad_config_sections_are_errors(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"requestLog": section}, REGISTRY)


def write_config(path: Path, **overrides: object) -> Path:
    document: dict[str, object] = {
        "server": {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}},
        "endpoints": [{"address": "127.0.0.1:9"}],
    }
    document.update(overrides)
    path.write_text(yaml.safe_dump(document))
    return path


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD]


def ready_request(app: PickerApp, prompt: str) -> None:
    """Route and finish one request through the app's director (its endpoint marked ready)."""
    for endpoint in app.store.all():
        app.store.update_metrics(endpoint.id, waiting=0.0, running=0.0, kv_usage=0.0)
    request = app.director.parse(completion(prompt), {})
    assert ARRIVAL_STATE in request.state or app.request_log is None
    app.director.route(request).finish(output_tokens=3)


async def test_the_log_is_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "c.yaml")
    app = PickerApp(load_config(config, REGISTRY), REGISTRY)
    assert app.request_log is None and app.director.request_log is None
    await app.start()
    try:
        assert not writer_threads()
        request = app.director.parse(completion("abcd" * 600), {})
        assert ARRIVAL_STATE not in request.state
        ready_request(app, "abcd" * 600)
        assert "kv_picker_request_log" not in app.metrics.exposition().decode()
    finally:
        await app.stop(grace_s=0.5)
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


async def test_the_app_writes_the_log_and_flushes_it_on_stop(tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "requests.jsonl"
    config = write_config(tmp_path / "c.yaml", requestLog={"path": str(log_path), "salt": "x"})
    app = PickerApp(load_config(config, REGISTRY), REGISTRY)
    await app.start()
    try:
        assert len(writer_threads()) == 1
        for i in range(3):
            ready_request(app, words(f"q{i}", 700))
    finally:
        await app.stop(grace_s=0.5)
    assert not writer_threads()
    assert [row["output_length"] for row in rows_of(log_path)] == [3, 3, 3]
    assert "kv_picker_request_log_rows_total 3.0" in app.metrics.exposition().decode()
