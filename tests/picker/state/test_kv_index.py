"""The in-process precise index against a brute-force model (tiers, groups, bounds), and its
event-to-key rules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.block_events import (
    DROP_ATTENTION,
    DROP_BAD_TOKENS,
    DROP_BLOCK_SIZE,
    DROP_EXTRA_KEYS,
    DROP_LORA_ID,
    DROP_MEDIUM,
    DROP_TOKEN_COUNT,
    DROP_UNKNOWN_HASH,
    DROP_UNKNOWN_PARENT,
    BlockRemoved,
    BlockStored,
    EventKeys,
    KVEvent,
    Tiers,
)
from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.hashing import chain_root, token_keys
from kv_picker.state.kv_index import KVBlockIndex, LedgerLayout
from tests.picker.state.kv_model import (
    NUM_ENDPOINTS,
    NUM_KEYS,
    TIER_WEIGHTS,
    Model,
    operations,
    queries,
)


@pytest.mark.parametrize("layout", ["compact", "dict"])
@settings(max_examples=500, deadline=None)
@given(
    operations,
    queries,
    st.sets(st.integers(0, NUM_ENDPOINTS - 1)),
    st.lists(st.integers(0, 6), min_size=NUM_ENDPOINTS, max_size=NUM_ENDPOINTS),
    st.integers(1, 30),
)
def test_matches_brute_force_model(
    layout: LedgerLayout,
    ops: list[tuple[int, KVEvent]],
    query: list[int],
    candidates: set[int],
    scraped_capacities: list[int],
    max_blocks: int,
) -> None:
    default_capacity = 5
    index = KVBlockIndex(
        EventKeys(key_mode="strict", tiers=Tiers(TIER_WEIGHTS)),
        default_capacity_blocks=default_capacity,
        max_blocks=max_blocks,
        capacity_source=scraped_capacities,
        layout=layout,
    )
    model = Model([c or default_capacity for c in scraped_capacities], default_capacity, max_blocks)
    for endpoint, event in ops:
        if isinstance(event, BlockStored):
            index.apply_stored(endpoint, event, "m")
        elif isinstance(event, BlockRemoved):
            index.apply_removed(endpoint, event)
        else:
            index.clear_endpoint(endpoint)
        model.apply(endpoint, event)
        assert index.num_blocks() == len(model.entries)
        assert index.num_blocks() <= max_blocks
        # Every block's holders, tier by tier, as one-block lookups of every endpoint.
        for key in range(1, NUM_KEYS + 1):
            one_runs = [0] * NUM_ENDPOINTS
            one_weighted = [0.0] * NUM_ENDPOINTS
            index.runs([key], (1 << NUM_ENDPOINTS) - 1, one_runs, weighted_out=one_weighted)
            expected_one = model.runs([key], set(range(NUM_ENDPOINTS)))
            assert [(one_runs[e], one_weighted[e]) for e in range(NUM_ENDPOINTS)] == [
                expected_one[e] for e in range(NUM_ENDPOINTS)
            ], key
    for endpoint in range(NUM_ENDPOINTS):
        for tier in range(3):
            assert set(index.ledger.keys(endpoint, tier)) == model.held(endpoint, tier)
    mask = sum(1 << e for e in candidates)
    expected = model.runs(query, candidates)
    runs_out = [-1] * NUM_ENDPOINTS
    weighted_out = [-1.0] * NUM_ENDPOINTS
    best = index.runs(query, mask, runs_out, weighted_out=weighted_out)
    assert {e: runs_out[e] for e in candidates} == {e: r for e, (r, _) in expected.items()}
    assert {e: weighted_out[e] for e in candidates} == pytest.approx(
        {e: w for e, (_, w) in expected.items()}
    )
    assert all(runs_out[e] == -1 for e in range(NUM_ENDPOINTS) if e not in candidates)
    assert all(weighted_out[e] == -1 for e in range(NUM_ENDPOINTS) if e not in candidates)
    assert best == max((r for r, _ in expected.values()), default=0)
    # Without weights: the same runs.
    unweighted = [-1] * NUM_ENDPOINTS
    assert index.runs(query, mask, unweighted) == best
    assert [unweighted[e] for e in candidates] == [runs_out[e] for e in candidates]
    distinct = {v[0] for v in model.entries.values()}
    assert index.num_keys() == len(distinct)


def dual_index(on_drop: Callable[[str, int], None] | None = None, **kwargs: Any) -> KVBlockIndex:
    return KVBlockIndex(EventKeys(block_size_tokens=4, on_drop=on_drop), **kwargs)


def request_keys(index: KVBlockIndex, tokens: list[int], **kwargs: str) -> list[int]:
    return index.event_keys.request_keys(
        tokens, kwargs.get("model", "m"), kwargs.get("lora"), kwargs.get("salt")
    )


def test_dual_keys_from_events_match_request_keys() -> None:
    index = dual_index()
    tokens = list(range(100, 124))  # six blocks of 4
    # Stored in two events, as prefill chunks arrive: the second continues from its parent.
    assert index.apply_stored(0, BlockStored([11, 12, 13], None, tokens[:12], 4), "m") == 3
    assert index.apply_stored(0, BlockStored([14, 15, 16], 13, tokens[12:], 4), "m") == 3
    keys = request_keys(index, [*tokens, 1, 2])
    assert len(keys) == 6
    runs = [0, 0]
    assert index.runs(keys, 0b11, runs) == 6
    assert runs == [6, 0]
    # Removal by engine hash cuts the run at that block.
    assert index.apply_removed(0, BlockRemoved([14, 99])) == 1
    index.runs(keys, 0b11, runs)
    assert runs == [3, 0]
    # Another endpoint holding the first two blocks.
    index.apply_stored(1, BlockStored([21, 22], None, tokens[:8], 4), "m")
    index.runs(keys, 0b11, runs)
    assert runs == [3, 2]
    assert index.clear_endpoint(0) == 5
    index.runs(keys, 0b11, runs)
    assert runs == [0, 2]


def test_model_salt_and_adapter_separate_chains() -> None:
    index = dual_index()
    tokens = list(range(16))
    index.apply_stored(
        0, BlockStored([1, 2, 3, 4], None, tokens, 4, extra_keys=[("s1",), None, None]), "m"
    )
    index.apply_stored(1, BlockStored([5, 6, 7, 8], None, tokens, 4), "m")
    index.apply_stored(
        2,
        BlockStored([9, 10, 11, 12], None, tokens, 4, lora_name="ad", extra_keys=[("ad",)] * 4),
        "m",
    )
    runs = [0, 0, 0]
    index.runs(request_keys(index, tokens, salt="s1"), 0b111, runs)
    assert runs == [4, 0, 0]
    index.runs(request_keys(index, tokens), 0b111, runs)
    assert runs == [0, 4, 0]
    index.runs(request_keys(index, tokens, salt="s2"), 0b111, runs)
    assert runs == [0, 0, 0]
    index.runs(request_keys(index, tokens, lora="ad"), 0b111, runs)
    assert runs == [0, 0, 4]
    index.runs(request_keys(index, tokens, model="other"), 0b111, runs)
    assert runs == [0, 0, 0]
    # Salt and adapter together: vLLM's block 0 extra keys are (lora, salt).
    index.apply_stored(
        0,
        BlockStored(
            [13, 14], None, tokens[:8], 4, lora_name="ad", extra_keys=[("ad", "s1"), ("ad",)]
        ),
        "m",
    )
    index.runs(request_keys(index, tokens, lora="ad", salt="s1"), 0b111, runs)
    assert runs == [2, 0, 0]


def test_what_is_not_indexed() -> None:
    drops: list[tuple[str, int]] = []
    index = dual_index(on_drop=lambda reason, n: drops.append((reason, n)))
    tokens = list(range(8))
    assert index.apply_stored(0, BlockStored([1, 2], 99, tokens, 4), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 6), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens[:7], 4), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 4, medium="NVME"), "m") == 0
    assert index.apply_stored(0, BlockStored([1, 2], None, tokens, 4, lora_id=3), "m") == 0
    # A multimodal key on block 1: block 0 is indexed, the rest is not.
    assert (
        index.apply_stored(
            0, BlockStored([1, 2], None, tokens, 4, extra_keys=[None, ("img",)]), "m"
        )
        == 1
    )
    assert drops == [
        (DROP_UNKNOWN_PARENT, 2),
        (DROP_BLOCK_SIZE, 2),
        (DROP_TOKEN_COUNT, 2),
        (DROP_MEDIUM, 2),
        (DROP_LORA_ID, 2),
        (DROP_EXTRA_KEYS, 1),
    ]
    for kind in ("sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba"):
        stored = BlockStored([3], None, tokens[:4], 4, group_idx=1, kv_cache_spec_kind=kind)
        assert index.apply_stored(0, stored, "m") == 0
    assert drops[-1] == (DROP_ATTENTION, 1)
    assert index.apply_stored(0, BlockStored([3], None, [2**40] * 4, 4), "m") == 0
    assert index.apply_stored(0, BlockStored([4], None, [], 0, medium="CPU"), "m") == 0
    assert drops[-2:] == [(DROP_BAD_TOKENS, 1), (DROP_UNKNOWN_HASH, 1)]
    assert index.num_blocks() == 1
    # GPU medium in either spelling, and no medium, are indexed.
    assert index.apply_stored(1, BlockStored([5], None, tokens[:4], 4, medium="GPU"), "m") == 1
    assert index.apply_stored(1, BlockStored([6], None, tokens[:4], 4, medium="gpu"), "m") == 1


def test_mla_and_sink_attention_are_full_attention_and_kinds_are_learned() -> None:
    index = dual_index()
    tokens = list(range(12))
    for endpoint, kind in enumerate(("mla_attention", "sink_full_attention", "full_attention")):
        event = BlockStored([1, 2, 3], None, tokens, 4, group_idx=0, kv_cache_spec_kind=kind)
        assert index.apply_stored(endpoint, event, "m") == 3
    runs = [0, 0, 0]
    assert index.runs(request_keys(index, tokens), 0b111, runs) == 3
    assert runs == [3, 3, 3]
    # Group 1 said once it is a sliding window: its later events without a kind are not indexed.
    window = BlockStored([9], None, tokens[:4], 4, group_idx=1, kv_cache_spec_kind="sliding_window")
    assert index.apply_stored(0, window, "m") == 0
    assert index.apply_stored(0, BlockStored([9], None, tokens[:4], 4, group_idx=1), "m") == 0
    # A group never described is taken for full attention (older vLLM sends no kind).
    assert index.apply_stored(1, BlockStored([9], None, tokens[:4], 4, group_idx=1), "m") == 1


def test_removals_respect_tier_and_group() -> None:
    """A CPU-tier eviction or another group's removal leaves the GPU full-attention entry."""
    index = dual_index()
    tokens = list(range(16))
    keys = request_keys(index, tokens)
    gpu = BlockStored([1, 2, 3, 4], None, tokens, 4, medium="GPU", group_idx=0)
    assert index.apply_stored(0, gpu, "m") == 4
    window = BlockStored(
        [1, 2, 3, 4], None, tokens, 4, group_idx=1, kv_cache_spec_kind="sliding_window"
    )
    assert index.apply_stored(0, window, "m") == 0
    cpu = BlockStored([1, 2, 3, 4], None, tokens, 4, medium="CPU", group_idx=0)
    assert index.apply_stored(0, cpu, "m") == 4
    runs, weighted = [0], [0.0]
    assert index.apply_removed(0, BlockRemoved([1, 2], medium="CPU", group_idx=0)) == 2
    assert index.apply_removed(0, BlockRemoved([1, 2, 3, 4], medium="GPU", group_idx=1)) == 0
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [4] and weighted == [4.0]
    # The GPU copy of blocks 2 and 3 goes: the CPU copy of 3 (weight 0.8) still counts, 2 not.
    assert index.apply_removed(0, BlockRemoved([3], medium="GPU")) == 1
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [4] and weighted == [pytest.approx(3.8)]
    assert index.apply_removed(0, BlockRemoved([2], medium="GPU", group_idx=0)) == 1
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [1] and weighted == [1.0]
    # AllBlocksCleared names no tier or group: all of the endpoint's entries go.
    assert index.clear_endpoint(0) == 4
    assert index.num_blocks() == 0 and index.num_keys() == 0


def test_several_full_attention_groups_hold_a_block_until_the_last_one_drops_it() -> None:
    index = dual_index()
    tokens = list(range(8))
    keys = request_keys(index, tokens)
    for group in (0, 2):
        event = BlockStored(
            [1, 2], None, tokens, 4, group_idx=group, kv_cache_spec_kind="full_attention"
        )
        assert index.apply_stored(0, event, "m") == 2
    runs = [0]
    assert index.apply_removed(0, BlockRemoved([2], group_idx=2)) == 1
    assert index.runs(keys, 0b1, runs) == 2
    assert index.apply_removed(0, BlockRemoved([2], group_idx=0)) == 1
    assert index.runs(keys, 0b1, runs) == 1


def test_cpu_tier_events_without_tokens_resolve_through_the_engine_hashes() -> None:
    """An offloading connector's placeholder event names a block by its engine hash alone."""
    index = dual_index()
    tokens = list(range(12))
    keys = request_keys(index, tokens)
    index.apply_stored(0, BlockStored([1, 2, 3], None, tokens, 4), "m")
    placeholder = BlockStored([1, 2, 3, 99], None, [], 0, medium="CPU", group_idx=0)
    assert index.apply_stored(0, placeholder, "m") == 3  # 99 names nothing known
    # Offloaded blocks announced once per chunk overlapping them: counted, as many removals.
    assert index.apply_stored(0, BlockStored([1], None, [], 0, medium="CPU"), "m") == 1
    assert index.apply_removed(0, BlockRemoved([1, 2, 3], medium="GPU")) == 3
    runs, weighted = [0], [0.0]
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [3] and weighted == [pytest.approx(2.4)]
    assert index.apply_removed(0, BlockRemoved([1], medium="CPU")) == 1
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [3]
    assert index.apply_removed(0, BlockRemoved([1], medium="CPU")) == 1
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [0] and weighted == [0.0]
    # A CPU event with tokens continues a chain whose parent is on the GPU tier.
    index.apply_stored(1, BlockStored([5], None, tokens[:4], 4), "m")
    assert index.apply_stored(1, BlockStored([6, 7], 5, tokens[4:], 4, medium="CPU"), "m") == 2
    index.runs(keys, 0b10, runs, weighted_out=weighted)
    assert runs[1] == 3 and weighted[1] == pytest.approx(2.6)


def test_tiers_and_their_weights() -> None:
    tiers = Tiers({"GPU": 1.0, "cpu": 0.5, "lmcache": 0.7, "disk": 0.3})
    assert [tiers.id_of(m) for m in (None, "GPU", "Cpu", "STORAGE", "LMCache", "disk")] == [
        0,
        0,
        1,
        None,
        4,
        3,
    ]
    assert tiers.weights == (1.0, 0.5, 0.0, 0.3, 0.7)
    for bad in ({"cpu": 0.8}, {"gpu": 1.0, "GPU": 0.9}, {"gpu": 1.5}, {"gpu": 0.0}):
        with pytest.raises(ValueError):
            Tiers(bad)
    with pytest.raises(ValueError):
        Tiers({"gpu": 1.0, **{f"t{i}": 0.5 for i in range(6)}})
    index = KVBlockIndex(EventKeys(block_size_tokens=4, tiers=tiers))
    tokens = list(range(8))
    index.apply_stored(0, BlockStored([1, 2], None, tokens, 4, medium="LMCache"), "m")
    runs, weighted = [0], [0.0]
    index.runs(request_keys(index, tokens), 0b1, runs, weighted_out=weighted)
    assert runs == [2] and weighted == [pytest.approx(1.4)]


def test_strict_mode_needs_no_tokens() -> None:
    index = KVBlockIndex(EventKeys(16, "strict", "xxhash", "0"))
    tokens = list(range(1, 33))
    wire = index.event_keys.request_keys(tokens, "m", None, None)
    assert index.apply_stored(3, BlockStored(wire, None, [], 16), "m") == 2
    runs = [0] * 4
    assert index.runs(wire, 0b1000, runs) == 2
    assert runs[3] == 2


def test_restored_block_refreshes_recency_and_capacity_follows_the_scrape() -> None:
    capacities = [0]
    index = dual_index(default_capacity_blocks=3, capacity_source=capacities)
    tokens = list(range(4))
    for engine_hash in (1, 2, 3):
        index.apply_stored(0, BlockStored([engine_hash], None, [engine_hash] * 4, 4), "m")
    index.apply_stored(0, BlockStored([1], None, [1] * 4, 4), "m")  # 1 is the most recent again
    index.apply_stored(0, BlockStored([4], None, tokens, 4), "m")
    assert list(index.ledger.keys(0)) == [
        token_keys(tokens_of, chain_root("m"), 4)[0] for tokens_of in ([3] * 4, [1] * 4, tokens)
    ]
    assert index.ledger.get(0, 2) is None
    capacities[0] = 1  # the scraper learned the real capacity
    index.apply_stored(0, BlockStored([5], None, [5] * 4, 4), "m")
    assert index.num_blocks() == 1 and index.ledger.get(0, 5) is not None
    assert index.num_evicted_blocks() == 4


def test_remove_endpoint_forgets_it() -> None:
    index = dual_index()
    index.apply_stored(2, BlockStored([1, 2], None, list(range(8)), 4), "m")
    index.remove_endpoint(2)
    assert index.num_blocks() == 0 and index.num_keys() == 0
    index.apply_stored(2, BlockStored([1], None, list(range(4)), 4), "m")
    assert index.num_blocks() == 1


def test_ledger_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        BlockLedger(0, 10, None, lambda e, k: None)
    with pytest.raises(ValueError):
        EventKeys(key_mode="fuzzy")


async def test_in_process_there_is_nothing_to_fetch_run_or_close() -> None:
    index = dual_index()
    tokens = list(range(8))
    index.apply_stored(0, BlockStored([1, 2], None, tokens, 4), "m")
    keys = request_keys(index, tokens)
    assert index.prefetch(keys) is None  # no coroutine: runs() reads memory
    runs = [0]
    assert index.runs(keys, 0b1, runs, None) == 2
    await asyncio.wait_for(index.run(), 1.0)  # returns at once
    await index.close()


@pytest.mark.parametrize("multiple", [2, 4])
def test_engine_blocks_of_several_of_ours(multiple: int) -> None:
    """Events whose block size is a multiple of ours (an offloading connector's chunks, a
    hybrid model's group) index each engine block as that many of ours, exactly the keys the
    same tokens give in blocks of our size; removals and placeholders name the whole block."""
    size = 4 * multiple
    tokens = list(range(500, 500 + 3 * size))  # three engine blocks
    index, same = dual_index(), dual_index()
    assert index.apply_stored(0, BlockStored([7, 8], None, tokens[: 2 * size], size), "m") == (
        2 * multiple
    )
    # The next event continues from its parent: the engine block 8, our last block of it.
    assert index.apply_stored(0, BlockStored([9], 8, tokens[2 * size :], size), "m") == multiple
    ours = len(tokens) // 4
    same.apply_stored(0, BlockStored(list(range(ours)), None, tokens, 4), "m")
    keys = request_keys(index, tokens)
    assert keys == request_keys(same, tokens) and len(keys) == ours
    runs, reference = [0], [0]
    index.runs(keys, 0b1, runs)
    same.runs(keys, 0b1, reference)
    assert runs == reference == [ours]
    # Removing engine block 8 removes all of its blocks of ours: the run stops after block 7.
    assert index.apply_removed(0, BlockRemoved([8])) == 1
    index.runs(keys, 0b1, runs)
    assert runs == [multiple]
    # A placeholder CPU event names engine block 7 by hash: all of its blocks of ours.
    assert index.apply_stored(0, BlockStored([7], None, [], 0, medium="CPU"), "m") == multiple
    assert index.apply_removed(0, BlockRemoved([7], medium="GPU")) == 1
    weighted = [0.0]
    index.runs(keys, 0b1, runs, weighted_out=weighted)
    assert runs == [multiple] and weighted == [pytest.approx(0.8 * multiple)]
    index.remove_endpoint(0)
    assert index.ledger.multiple(0, 0, 0) == 1


def test_a_block_size_that_is_not_a_multiple_of_ours_is_dropped() -> None:
    drops: list[tuple[str, int]] = []
    index = dual_index(on_drop=lambda reason, blocks: drops.append((reason, blocks)))
    assert index.apply_stored(0, BlockStored([1], None, list(range(6)), 6), "m") == 0
    assert drops == [("block_size", 1)]
