"""Trace loaders on good and bad files, generators, slicing and prompt text."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kv_picker_bench.harness.traces import (
    CHARS_PER_TOKEN,
    ChatSpec,
    SharedPrefixSpec,
    TraceError,
    TraceRequest,
    block_text,
    load_trace,
    parse_stages,
    parse_trace_spec,
    prompt_text,
    scale_rate,
    slice_trace,
    write_kv_picker_jsonl,
)
from kv_picker_bench.sim.tokenizer import encode

# shared/ sits beside the repository (development machines and CI alike).
MOONCAKE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "conversation_trace.jsonl"


def write_lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake_row(timestamp: int = 0, length: int = 1000, ids: list[int] | None = None) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": length,
        "output_length": 10,
        "hash_ids": ids if ids is not None else [0, 1],
    }


def test_mooncake_good_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "m.jsonl",
        [mooncake_row(0, 1000, [0, 1]), mooncake_row(1500, 513, [0, 2]), ""],
    )
    trace = load_trace(path)
    assert trace.block_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.5]
    assert trace.requests[1].hash_ids == [0, 2]
    assert trace.requests[1].line == 2


@pytest.mark.parametrize(
    ("row", "field", "fragment"),
    [
        ("{not json", None, "not valid JSON"),
        ([1, 2], None, "expected a JSON object"),
        ({"input_length": 10, "output_length": 1, "hash_ids": [0]}, "timestamp", "missing"),
        (mooncake_row() | {"timestamp": "soon"}, "timestamp", "expected a number"),
        (mooncake_row() | {"input_length": 0}, "input_length", "must be >= 1"),
        (mooncake_row() | {"output_length": 2.5}, "output_length", "expected an integer"),
        (mooncake_row() | {"hash_ids": "0,1"}, "hash_ids", "expected a list"),
        (mooncake_row() | {"hash_ids": [0, -1]}, "hash_ids", "item 1"),
        (mooncake_row(0, 1025, [0, 1]), "hash_ids", "need ceil(1025/512) = 3"),
    ],
)
def test_mooncake_bad_rows_name_file_line_and_field(
    tmp_path: Path, row: object, field: str | None, fragment: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [mooncake_row(), row])
    with pytest.raises(TraceError) as info:
        from kv_picker_bench.harness.traces import load_mooncake

        load_mooncake(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2:")
    if field:
        assert f"field {field!r}" in message
    assert fragment in message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(TraceError, match="no requests"):
        load_trace(empty)
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(empty, fmt="csv")


def test_unsorted_rows_are_sorted_stably(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "m.jsonl",
        [mooncake_row(2000, 10, [5]), mooncake_row(0, 10, [6]), mooncake_row(0, 10, [7])],
    )
    trace = load_trace(path)
    assert [r.hash_ids[0] for r in trace.requests] == [6, 7, 5]
    assert [r.index for r in trace.requests] == [0, 1, 2]


def test_kv_picker_format_with_ids_and_text(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "k.jsonl",
        [
            {"kv_picker_trace": 1, "block_tokens": 4, "name": "mine"},
            {"arrival_s": 0.5, "input_tokens": 9, "output_tokens": 3, "hash_ids": [1, 2, 3]},
            {"arrival_s": 0.0, "prompt": "one two three four five six", "output_tokens": 2},
            {
                "arrival_s": 1.0,
                "prompt": "one two three four nine",
                "output_tokens": 2,
                "session": "s",
            },
        ],
    )
    trace = load_trace(path)
    assert trace.name == "mine" and trace.block_tokens == 4
    text_a, ids_row, text_b = trace.requests
    assert ids_row.hash_ids == [1, 2, 3]
    assert text_a.input_tokens == len(encode("one two three four five six")) == 6
    # Equal first 4-token block -> equal first id; ids of text rows do not collide with given ones.
    assert text_a.hash_ids[0] == text_b.hash_ids[0] != text_a.hash_ids[1]
    assert min(text_a.hash_ids) > 3
    assert text_b.session == "s"
    assert prompt_text(text_a, 4) == "one two three four five six"


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"arrival_s": 0, "output_tokens": 1}, "field 'input_tokens': missing"),
        ({"arrival_s": 0, "output_tokens": 1, "prompt": ""}, "field 'prompt'"),
        ({"arrival_s": -1, "output_tokens": 1, "prompt": "x"}, "field 'arrival_s': must be >= 0"),
        ({"arrival_s": 0, "output_tokens": 1, "prompt": "x", "hash_ids": [1]}, "not both"),
        ({"arrival_s": 0, "output_tokens": 1, "prompt": "x", "colour": 1}, "field 'colour'"),
        (
            {"arrival_s": 0, "output_tokens": 1, "prompt": "a b", "input_tokens": 5},
            "does not match",
        ),
        ({"kv_picker_trace": 1, "block_tokens": 16}, "the header must be the first line"),
        ({"arrival_s": 0, "output_tokens": 1, "prompt": "x", "lora": 5}, "field 'lora'"),
        ({"arrival_s": 0, "output_tokens": 1, "prompt": "x", "cache_salt": ""}, "'cache_salt'"),
        (
            {
                "arrival_s": 0,
                "output_tokens": 1,
                "input_tokens": 3,
                "hash_ids": [2**40],
                "cache_salt": "a",
            },
            "field 'hash_ids': ids must be below 2**40",
        ),
        (
            {"arrival_s": 0, "output_tokens": 1, "input_tokens": 3, "hash_ids": [2**41]},
            "field 'hash_ids': ids must be below 2**40",
        ),
    ],
)
def test_kv_picker_format_bad_rows(tmp_path: Path, row: dict, fragment: str) -> None:
    # The first row names a salt, so ids of any row must leave room for namespaces.
    first = {"arrival_s": 0, "prompt": "hi", "output_tokens": 1, "cache_salt": "t"}
    path = write_lines(tmp_path / "k.jsonl", [first, row])
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt="kv-picker")
    assert str(info.value).startswith(f"{path}:2:")
    assert fragment in str(info.value)


def test_kv_picker_header_version(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "k.jsonl", [{"kv_picker_trace": 2, "block_tokens": 16}])
    with pytest.raises(TraceError, match=r":1: field 'kv_picker_trace': unsupported version"):
        load_trace(path, fmt="kv-picker")


def test_write_and_read_back(tmp_path: Path) -> None:
    trace = ChatSpec(sessions=3, turns=2, system_tokens=40, user_tokens=10, output_tokens=5).build()
    path = tmp_path / "chat.jsonl"
    write_kv_picker_jsonl(trace, path)
    again = load_trace(path)
    assert again.block_tokens == trace.block_tokens
    assert [(r.input_tokens, r.hash_ids, r.session) for r in again.requests] == [
        (r.input_tokens, r.hash_ids, r.session) for r in trace.requests
    ]


def test_adapters_and_salts_keep_equal_content_apart(tmp_path: Path) -> None:
    row = {"arrival_s": 0, "input_tokens": 40, "output_tokens": 8, "hash_ids": [1, 2, 3]}
    variants = [{}, {"lora": "a"}, {"lora": "b"}, {"cache_salt": "t"}, {"lora": "a"}]
    variants.append({"lora": "a", "cache_salt": "t"})
    path = write_lines(
        tmp_path / "n.jsonl", [row | v | {"arrival_s": i} for i, v in enumerate(variants)]
    )
    trace = load_trace(path)
    plain, lora_a, lora_b, salted, lora_a_again, both = trace.requests
    assert plain.hash_ids == [1, 2, 3] and plain.lora is None and plain.salt is None
    assert lora_a.lora == "a" and salted.salt == "t" and (both.lora, both.salt) == ("a", "t")
    assert lora_a_again.hash_ids == lora_a.hash_ids
    distinct = [plain, lora_a, lora_b, salted, both]
    for first, second in itertools.combinations(distinct, 2):
        assert set(first.hash_ids).isdisjoint(second.hash_ids)
    assert all(r.content_ids == [1, 2, 3] for r in trace.requests)
    assert len({prompt_text(r, 16) for r in trace.requests}) == 1  # the same text for all

    again = tmp_path / "again.jsonl"
    write_kv_picker_jsonl(trace, again)
    written = [json.loads(line) for line in again.read_text().splitlines()[1:]]
    assert [r["hash_ids"] for r in written] == [[1, 2, 3]] * len(variants)
    assert [(r.get("lora"), r.get("cache_salt")) for r in written] == [
        (v.get("lora"), v.get("cache_salt")) for v in variants
    ]
    assert [r.hash_ids for r in load_trace(again).requests] == [r.hash_ids for r in trace.requests]


@pytest.mark.parametrize("family", ["lora", "tenants", "agentic"])
def test_families_survive_a_round_trip_through_the_file(tmp_path: Path, family: str) -> None:
    sizes = {"lora": "requests=80", "tenants": "requests=80", "agentic": "sessions=3"}
    trace = parse_trace_spec(f"{family}:seed=2,{sizes[family]}")
    path = tmp_path / "t.jsonl"
    write_kv_picker_jsonl(trace, path)
    again = load_trace(path)

    def fields(r: TraceRequest) -> tuple[object, ...]:
        return (r.input_tokens, r.content_ids, r.output_content_ids, r.lora, r.salt, r.session)

    assert [fields(r) for r in again.requests] == [fields(r) for r in trace.requests]
    # The same blocks are equal and the same blocks differ (the namespaces' numbers may not).
    pairs = {
        (a, b)
        for x, y in zip(trace.requests, again.requests, strict=True)
        for a, b in zip(x.hash_ids, y.hash_ids, strict=True)
    }
    assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)


def test_scale_rate_divides_arrival_times() -> None:
    trace = SharedPrefixSpec(groups=2, users=2, requests=20, rate=10).build()
    faster = scale_rate(trace, 4.0)
    assert [r.arrival_s for r in faster.requests] == pytest.approx(
        [r.arrival_s / 4 for r in trace.requests]
    )
    assert [r.hash_ids for r in faster.requests] == [r.hash_ids for r in trace.requests]
    assert faster.notes == ["rate x4"] and trace.notes == []
    assert faster.summary()["rate_per_s"] == pytest.approx(
        4 * trace.summary()["rate_per_s"], rel=1e-3
    )
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(TraceError, match="rate factor"):
            scale_rate(trace, bad)


def test_text_is_one_word_per_token_and_equal_ids_give_equal_prefixes() -> None:
    trace = SharedPrefixSpec(
        groups=2, users=2, context_tokens=100, question_tokens=30, requests=20
    ).build()
    texts = [prompt_text(r, trace.block_tokens) for r in trace.requests]
    for request, text in zip(trace.requests, texts, strict=True):
        assert len(text) == CHARS_PER_TOKEN * request.input_tokens
        assert len(encode(text)) == request.input_tokens
    by_group: dict[int, list[str]] = {}
    for request, text in zip(trace.requests, texts, strict=True):
        by_group.setdefault(request.hash_ids[0], []).append(text)
    shared_chars = CHARS_PER_TOKEN * 16 * (100 // 16)
    for group_texts in by_group.values():
        assert len({t[:shared_chars] for t in group_texts}) == 1
    assert len({t[:shared_chars] for t in texts}) == len(by_group)
    assert block_text(7, 3, 16) == block_text(7, 16, 16)[:12]


def test_shared_prefix_generator_structure() -> None:
    spec = SharedPrefixSpec(
        groups=3, users=2, context_tokens=100, question_tokens=40, requests=200, rate=50
    )
    trace = spec.build()
    assert len(trace.requests) == 200
    assert all(r.input_tokens == 140 and len(r.hash_ids) == 9 for r in trace.requests)
    contexts = {tuple(r.hash_ids[:6]) for r in trace.requests}
    assert len(contexts) == 3  # 100 // 16 = 6 shared blocks per group
    prompts = {tuple(r.hash_ids) for r in trace.requests}
    assert len(prompts) == 6  # fixed question per user, as inference-perf does
    unique = SharedPrefixSpec(groups=3, users=2, requests=50, unique=True).build()
    assert len({tuple(r.hash_ids) for r in unique.requests}) == 50
    assert trace.duration_s == pytest.approx(200 / 50, rel=0.3)
    assert spec.build().requests[5].hash_ids == trace.requests[5].hash_ids  # seeded


def test_chat_turns_extend_their_history() -> None:
    trace = ChatSpec(
        sessions=4, turns=3, groups=1, system_tokens=40, user_tokens=10, output_tokens=7
    ).build()
    sessions: dict[str, list] = {}
    for request in trace.requests:
        sessions.setdefault(request.session or "", []).append(request)
    assert len(sessions) == 4
    for turns in sessions.values():
        assert [t.input_tokens for t in turns] == [50, 67, 84]
        for earlier, later in itertools.pairwise(turns):
            full = earlier.input_tokens // 16
            assert later.hash_ids[:full] == earlier.hash_ids[:full]
            assert later.arrival_s >= earlier.arrival_s
    firsts = {turns[0].hash_ids[0] for turns in sessions.values()}
    assert len(firsts) == 1  # one shared system prompt


def test_trace_specs_and_llmd_preset() -> None:
    llmd = parse_trace_spec("llm-d")
    assert llmd.requests[0].input_tokens == 7200 and llmd.requests[0].output_tokens == 1000
    assert len({tuple(r.hash_ids) for r in llmd.requests}) <= 750
    assert 16_000 < len(llmd.requests) < 18_500  # the ladder: about 17,100 expected
    small = parse_trace_spec("llm-d:requests=30,rate=5")
    assert len(small.requests) == 30
    chat = parse_trace_spec("chat:sessions=2,turns=2,system=32,user=16,output=16,think=1")
    assert len(chat.requests) == 4
    with pytest.raises(TraceError, match="unknown parameter 'colour=1'"):
        parse_trace_spec("shared-prefix:colour=1")
    with pytest.raises(TraceError, match="bad value"):
        parse_trace_spec("shared-prefix:groups=many")
    with pytest.raises(TraceError, match="not a file and not a generator"):
        parse_trace_spec("nothing:here=1")
    assert parse_stages("15x50/3x20") == [(15.0, 50.0), (3.0, 20.0)]
    with pytest.raises(TraceError, match="RATExSECONDS"):
        parse_stages("15")


def test_slicing_and_load_scaling() -> None:
    trace = SharedPrefixSpec(groups=2, users=2, requests=100, rate=10).build()
    window = slice_trace(trace, window_s=(2.0, 6.0))
    assert all(0 <= r.arrival_s < 4.0 for r in window.requests)
    assert window.requests[0].arrival_s == 0.0
    first = slice_trace(trace, first=10, load=2.0)
    assert len(first.requests) == 10
    original = [r.arrival_s - trace.requests[0].arrival_s for r in trace.requests[:10]]
    assert [r.arrival_s for r in first.requests] == pytest.approx([a / 2 for a in original])
    assert [r.index for r in first.requests] == list(range(10))
    assert first.notes == ["first 10", "load x2"]
    assert trace.requests[3].arrival_s != first.requests[3].arrival_s  # the original is intact
    with pytest.raises(TraceError, match="no request left"):
        slice_trace(trace, window_s=(1e6, 1e6 + 1))
    with pytest.raises(TraceError, match="load must be"):
        slice_trace(trace, load=0)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_real_mooncake_trace() -> None:
    trace = load_trace(MOONCAKE)
    assert len(trace.requests) == 12_031
    assert all(r.hash_ids[0] == 0 for r in trace.requests)  # the universal first block
    assert trace.summary()["rate_per_s"] == pytest.approx(3.40, abs=0.01)
