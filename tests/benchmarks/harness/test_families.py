"""Workload families: seeded draws, overrides, the sharing each family promises, replays."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from kv_picker_bench.harness.cli import replay_main
from kv_picker_bench.harness.families import FAMILIES, GENERATORS, Range
from kv_picker_bench.harness.report import hit_ratio_bounds
from kv_picker_bench.harness.synthesis import PrefixBlocks, gamma_arrivals
from kv_picker_bench.harness.traces import (
    CHARS_PER_TOKEN,
    CONTENT_ID_LIMIT,
    Trace,
    TraceError,
    TraceRequest,
    parse_trace_spec,
    prompt_text,
)
from tests.benchmarks.harness.conftest import small_cluster

# Small members of each family: a few dozen requests, short prompts (seconds to replay).
SMALL: dict[str, dict[str, int | float]] = {
    "shared-prefix": {"requests": 40, "groups": 4, "context_tokens": 300},
    "chat": {"sessions": 10, "turns": 3, "system_tokens": 200},
    "zipf-prefix": {"requests": 60, "groups": 8, "context_max_tokens": 4000},
    "long-doc-qa": {
        "sessions": 6,
        "questions_per_session": 3,
        "document_min_tokens": 2000,
        "document_max_tokens": 4000,
    },
    "agentic": {"sessions": 4, "min_turns": 3, "max_turns": 6, "system_tokens": 500},
    "rag": {"requests": 60, "chunks": 40, "chunk_tokens": 128},
    "mixed": {"requests": 60, "document_min_tokens": 1000, "document_max_tokens": 3000},
    "lora": {"requests": 60, "adapters": 6, "base_share": 0.2},
    "tenants": {"requests": 60, "tenants": 3, "system_tokens": 600},
}


def small(name: str, seed: int | None = 1, **overrides: float) -> Trace:
    return FAMILIES[name].build(seed, **{**SMALL[name], **overrides})


def rows(trace: Trace) -> list[tuple[object, ...]]:
    return [dataclasses.astuple(r) for r in trace.requests]


def full_blocks(request: TraceRequest, block_tokens: int) -> list[int]:
    return request.hash_ids[: request.input_tokens // block_tokens]


def test_every_family_is_registered_and_parsed() -> None:
    assert set(SMALL) == set(FAMILIES)
    assert set(GENERATORS) == set(FAMILIES) | {"llm-d"}
    for name, family in FAMILIES.items():
        assert family.name == name and family.description
        assert "\n" not in family.description and len(family.description) < 100
    trace = parse_trace_spec("agentic:seed=3,sessions=2,min_turns=2,max_turns=3,system=64")
    assert trace.name == "agentic-s3" and trace.source.startswith("agentic:seed=3")
    assert len({r.session for r in trace.requests}) == 2
    with pytest.raises(TraceError, match="unknown parameter 'colour=1'"):
        parse_trace_spec("rag:colour=1")
    with pytest.raises(TraceError, match="bad value"):
        parse_trace_spec("rag:seed=x")
    with pytest.raises(TraceError, match="unknown parameter 'colour'"):
        FAMILIES["rag"].build(1, colour=2)
    with pytest.raises(TraceError, match="top_k must be <= chunks"):
        FAMILIES["rag"].build(None, chunks=3, top_k=4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_seed_gives_one_workload(name: str) -> None:
    assert rows(small(name, 7)) == rows(small(name, 7))
    assert rows(small(name, 7)) != rows(small(name, 8))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_seeds_draw_parameters_within_their_ranges(name: str) -> None:
    family = FAMILIES[name]
    ranges = family.ranges()
    assert ranges, "a family draws at least one parameter"
    draws = [family.draw(seed) for seed in range(12)]
    assert draws[1] != draws[2]
    for key, span in ranges.items():
        values = [draw[key] for draw in draws]
        assert all(span.low <= value <= span.high for value in values), key
        assert len(set(values)) > 1 or span.low == span.high, key
        assert span.low <= getattr(family.spec(), key) <= span.high, f"{key}: default"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_overrides_keep_the_other_draws_and_no_seed_keeps_the_defaults(name: str) -> None:
    family = FAMILIES[name]
    drawn = family.spec(5)
    key = next(iter(family.ranges()))
    forced = family.spec(5, **{key: getattr(drawn, key) + 1})
    assert getattr(forced, key) == getattr(drawn, key) + 1
    assert dataclasses.replace(forced, **{key: getattr(drawn, key)}) == drawn
    assert family.spec() == family.spec_type()
    assert drawn.seed == 5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_requests_are_well_formed_and_ids_name_their_prefix(name: str) -> None:
    trace = small(name, 3)
    size = trace.block_tokens
    assert [r.index for r in trace.requests] == list(range(len(trace.requests)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace.requests))
    # Equal ids must mean equal prefixes: each id always sits at one position after one id.
    before: dict[int, tuple[int, int]] = {}
    for request in trace.requests:
        assert request.input_tokens >= 1 and request.output_tokens >= 1
        assert len(request.hash_ids) == -(-request.input_tokens // size)
        chains = [request.hash_ids]
        if request.output_ids is not None:
            total = request.input_tokens + request.output_tokens
            assert len(request.output_ids) == -(-total // size)
            chains.append(request.output_ids[: total // size])
        for chain in chains:
            for position, hash_id in enumerate(chain):
                previous = chain[position - 1] if position else -1
                assert before.setdefault(hash_id, (position, previous)) == (position, previous)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hit_ratio_bounds_are_ratios_in_order(name: str) -> None:
    trace = small(name, 2)
    for capacity in (50, 400, 100_000):
        bounds = hit_ratio_bounds(trace, small_cluster(2, num_gpu_blocks=capacity))
        assert 0.0 <= bounds["pooled_lru"] <= bounds["unbounded"] <= 1.0


def test_default_sizes_stay_replayable() -> None:
    for name, family in FAMILIES.items():
        for seed in (None, 1, 2):
            count = len(family.build(seed).requests)
            assert 200 <= count <= 2000, f"{name} seed {seed}: {count} requests"


# ------------------------------------------------------------------ what each one promises


def test_zipf_prefix_popular_groups_get_more_requests() -> None:
    trace = FAMILIES["zipf-prefix"].build(4, groups=16, requests=800, zipf_exponent=1.0)
    counts = Counter(int((r.session or "").split("-")[0][1:]) for r in trace.requests)
    assert counts[0] > counts[15] and counts[0] > counts[8] > 0
    lengths = {len(full_blocks(r, 16)) for r in trace.requests}
    assert len(lengths) > 8  # contexts and questions of varied length
    flat = FAMILIES["zipf-prefix"].build(4, groups=16, requests=800, zipf_exponent=0.0)
    flat_counts = Counter(int((r.session or "").split("-")[0][1:]) for r in flat.requests)
    assert flat_counts[0] < counts[0]


def test_long_doc_qa_questions_burst_on_a_few_long_documents() -> None:
    trace = FAMILIES["long-doc-qa"].build(2)
    spec = FAMILIES["long-doc-qa"].spec(2)
    assert all(r.input_tokens > spec.document_min_tokens for r in trace.requests)
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in trace.requests:
        sessions[request.session or ""].append(request)
    documents = {tuple(r.hash_ids[: spec.document_min_tokens // 16]) for r in trace.requests}
    assert len(documents) <= spec.documents
    assert max(len(s) for s in sessions.values()) > 1
    for asked in sessions.values():
        shared = min(r.input_tokens for r in asked) // 16 - 15  # questions are under 240 tokens
        assert len({tuple(r.hash_ids[:shared]) for r in asked}) == 1
        assert len({tuple(r.hash_ids) for r in asked}) == len(asked)  # fresh questions


def test_agentic_calls_extend_the_previous_call_and_its_answer() -> None:
    trace = FAMILIES["agentic"].build(6)
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in trace.requests:
        sessions[request.session or ""].append(request)
    assert all(5 <= len(calls) <= 30 for calls in sessions.values())
    for calls in sessions.values():
        for earlier, later in itertools.pairwise(calls):
            assert later.arrival_s > earlier.arrival_s
            assert later.input_tokens > earlier.input_tokens + earlier.output_tokens
            assert later.hash_ids[: len(full_blocks(earlier, 16))] == full_blocks(earlier, 16)
            assert earlier.output_ids is not None
            answered = (earlier.input_tokens + earlier.output_tokens) // 16
            assert later.hash_ids[:answered] == earlier.output_ids[:answered]
    starts = {calls[0].hash_ids[0] for calls in sessions.values()}
    assert 1 <= len(starts) <= FAMILIES["agentic"].spec(6).agents


def test_rag_shares_the_system_prompt_and_repeated_chunk_orders_only() -> None:
    trace = FAMILIES["rag"].build(None, chunks=50, chunk_tokens=256, system_tokens=320)
    system_blocks = 320 // 16
    assert len({tuple(r.hash_ids[:system_blocks]) for r in trace.requests}) == 1
    after_system = Counter(r.hash_ids[system_blocks] for r in trace.requests)
    assert 1 < len(after_system) <= 50  # first chunks repeat, in more than one order
    assert after_system.most_common(1)[0][1] > len(trace.requests) / 50
    # A chunk's blocks behind another first chunk are other blocks (order matters).
    pairs = {tuple(r.hash_ids[system_blocks : system_blocks + 32]) for r in trace.requests}
    assert len(pairs) > len(after_system)
    assert len({tuple(r.hash_ids) for r in trace.requests}) == len(trace.requests)


def test_mixed_documents_share_nothing_but_their_instruction() -> None:
    spec = FAMILIES["mixed"].spec(3)
    trace = spec.build()
    documents = [r for r in trace.requests if r.session is None]
    chats = [r for r in trace.requests if r.session is not None]
    assert len(documents) == round(spec.requests * spec.document_share)
    assert len(documents) + len(chats) == spec.requests
    assert all(r.input_tokens >= spec.document_min_tokens for r in documents)
    later = Counter(i for r in documents for i in r.hash_ids[spec.instruction_tokens // 16 :])
    assert set(later.values()) == {1}
    chat_ids = {i for r in chats for i in r.hash_ids}
    assert chat_ids.isdisjoint(i for r in documents for i in r.hash_ids)


def test_mixed_documents_and_chat_share_the_whole_span() -> None:
    # The matrix's draw (600 requests): documents arrive throughout, not in a burst before a
    # chat-only tail, so the cell's offered load holds over the whole trace.
    spec = FAMILIES["mixed"].spec(1)
    trace = dataclasses.replace(spec, requests=600).build()
    end_s = trace.requests[-1].arrival_s
    documents = [r.arrival_s for r in trace.requests if r.session is None]
    chats = [r for r in trace.requests if r.session is not None]
    for half in (0, 1):
        lo, hi = half * end_s / 2, (half + 1) * end_s / 2
        share = sum(lo <= t <= hi for t in documents) / len(documents)
        assert 0.3 < share < 0.7
    # Sessions are under way at time 0: an early turn can carry its session's earlier turns.
    early = [r for r in chats if r.arrival_s < end_s / 10]
    first_turn_tokens = spec.system_tokens * 1.25 + spec.user_tokens * 1.25 + 1
    assert any(r.input_tokens > first_turn_tokens for r in early)
    assert len({r.session for r in chats}) < len(chats)  # and sessions still have several turns


def test_lora_adapters_are_named_and_never_share_blocks() -> None:
    trace = FAMILIES["lora"].build(5, adapters=12, base_share=0.2, prefix_tokens=400)
    by_adapter: dict[str | None, set[int]] = defaultdict(set)
    for request in trace.requests:
        by_adapter[request.lora].update(request.hash_ids)
        assert request.salt is None
    assert None in by_adapter and len(by_adapter) > 5
    assert {name for name in by_adapter if name} <= {f"lora-{i}" for i in range(12)}
    for first, second in itertools.combinations(by_adapter.values(), 2):
        assert first.isdisjoint(second)
    # Within one adapter requests share its prefix.
    hot = Counter(r.lora for r in trace.requests).most_common(1)[0][0]
    firsts = {r.hash_ids[0] for r in trace.requests if r.lora == hot}
    assert len(firsts) == 1


def test_tenants_send_the_same_text_under_disjoint_ids() -> None:
    trace = FAMILIES["tenants"].build(9, tenants=4, system_tokens=700)
    system_blocks = 700 // 16
    by_salt: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in trace.requests:
        assert request.salt is not None and request.lora is None
        by_salt[request.salt].append(request)
    assert set(by_salt) == {f"tenant-{t}" for t in range(4)}
    contents = {tuple(r.content_ids[:system_blocks]) for r in trace.requests}
    assert len(contents) == 1  # one system prompt ...
    per_salt = [{i for r in group for i in r.hash_ids} for group in by_salt.values()]
    for first, second in itertools.combinations(per_salt, 2):
        assert first.isdisjoint(second)  # ... kept apart by the salt
    for group in by_salt.values():
        assert len({tuple(r.hash_ids[:system_blocks]) for r in group}) == 1
    chars = CHARS_PER_TOKEN * 16 * system_blocks
    texts = {prompt_text(group[0], 16)[:chars] for group in by_salt.values()}
    assert len(texts) == 1
    assert max(i for r in trace.requests for i in r.content_ids) < CONTENT_ID_LIMIT


def test_chat_and_shared_prefix_keep_their_defaults_without_a_seed() -> None:
    assert rows(parse_trace_spec("chat")) == rows(FAMILIES["chat"].spec_type().build())
    assert len(parse_trace_spec("shared-prefix").requests) == 750
    drawn = FAMILIES["shared-prefix"].spec(1)
    assert drawn != FAMILIES["shared-prefix"].spec_type()


# ------------------------------------------------------------------------ building blocks


def test_prefix_blocks_give_a_block_to_the_segment_that_ends_in_it() -> None:
    blocks = PrefixBlocks(16)
    system = blocks.child(blocks.root, "system", 40)
    assert blocks.prompt(system) == ([0, 1, 2], 40)  # two full blocks, a tail
    chunk_a = blocks.child(system, "a", 30)
    chunk_b = blocks.child(system, "b", 30)
    ids_a, tokens = blocks.prompt(chunk_a)
    ids_b, _ = blocks.prompt(chunk_b)
    assert tokens == 70 and ids_a[:2] == ids_b[:2] == [0, 1]
    assert ids_a[2] != 2 and ids_a[2] != ids_b[2]  # block 2 mixes system and chunk tokens
    assert blocks.child(system, "a", 30) is chunk_a
    with pytest.raises(ValueError, match="another length"):
        blocks.child(system, "a", 31)
    one, _ = blocks.prompt(blocks.unique(system, 8))
    two, _ = blocks.prompt(blocks.unique(system, 8))
    assert one[:2] == two[:2] and one[2] != two[2]


def test_gamma_arrivals_keep_the_rate_and_bunch_up_with_the_cv() -> None:
    smooth = gamma_arrivals(random.Random(1), 4000, 10.0, 1.0)
    bursty = gamma_arrivals(random.Random(1), 4000, 10.0, 3.0)
    for times in (smooth, bursty):
        assert times[-1] == pytest.approx(400.0, rel=0.15)

    def cv(times: list[float]) -> float:
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert cv(smooth) == pytest.approx(1.0, abs=0.1)
    assert cv(bursty) == pytest.approx(3.0, rel=0.2)


def test_a_family_without_randomized_parameters_only_seeds_the_build() -> None:
    llmd = GENERATORS["llm-d"]
    assert not llmd.ranges()
    assert llmd.spec(3) == dataclasses.replace(llmd.spec(), seed=3)
    assert {Range(1, 3).draw(random.Random(seed), "int") for seed in range(40)} == {1, 2, 3}
    rng = random.Random(0)
    sizes = [Range(2, 8, log=True).draw(rng, "float") for _ in range(400)]
    assert all(2 <= size <= 8 for size in sizes)
    # Log-uniform: 66% fall below the arithmetic middle (5), not half.
    assert 0.58 < sum(size < 5 for size in sizes) / len(sizes) < 0.74


# ------------------------------------------------------------------------------ replays


def _spec_text(name: str) -> str:
    return f"{name}:seed=1," + ",".join(f"{k}={v}" for k, v in SMALL[name].items())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_replays_offline(name: str, tmp_path: Path) -> None:
    out = tmp_path / name
    argv = ["--trace", _spec_text(name), "--endpoints", "2", "--quiet", "--no-plots"]
    argv += ["--policy", "kv-picker", "--policy", "gie-default", "--jobs", "1"]
    assert replay_main([*argv, "--out", str(out)]) == 0
    document = json.loads((out / "results.json").read_text())
    count = len(small(name, 1).requests)
    assert document["trace"]["requests"] == count
    for metrics in document["loads"]["1"]["policies"].values():
        assert metrics["ok"] == count
        assert metrics["errors"] == metrics["rejected"] == metrics["shed"] == 0


def test_families_command_lists_defaults_ranges_and_a_seed_draw(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kv_picker_bench.harness.families import main

    assert main(["zipf-prefix", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    drawn = FAMILIES["zipf-prefix"].spec(1)
    groups = next(line for line in out.splitlines() if line.strip().startswith("groups "))
    assert "default 48" in groups and "seed draws 16..128 (log)" in groups
    assert groups.endswith(f"seed 1: {drawn.groups!r}")  # type: ignore[attr-defined]
    assert "zipf_exponent (zipf)" in out  # the short alias --trace accepts

    assert main([]) == 0
    listing = capsys.readouterr().out
    assert all(f"\n{name}: " in "\n" + listing for name in GENERATORS)


def test_families_command_rejects_an_unknown_generator(capsys: pytest.CaptureFixture[str]) -> None:
    from kv_picker_bench.harness.families import main

    assert main(["nope"]) == 2
    assert "unknown generator 'nope'; generators: shared-prefix" in capsys.readouterr().err
