from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.approx_index import ApproximatePrefixIndex


def brute_force_runs(
    held: dict[int, list[int]], keys: list[int], candidates: set[int]
) -> dict[int, int]:
    runs = {}
    for endpoint in candidates:
        have = set(held.get(endpoint, []))
        run = 0
        for key in keys:
            if key not in have:
                break
            run += 1
        if run:
            runs[endpoint] = run
    return runs


operations = st.lists(
    st.tuples(st.integers(0, 5), st.lists(st.integers(0, 12), min_size=0, max_size=8)),
    max_size=30,
)


@settings(max_examples=200)
@given(
    operations,
    st.lists(st.integers(0, 12), max_size=10),
    st.sets(st.integers(0, 5)),
    st.integers(1, 6),
)
def test_matches_brute_force_lru_model(
    ops: list[tuple[int, list[int]]], query: list[int], candidates: set[int], capacity: int
) -> None:
    index = ApproximatePrefixIndex(capacity)
    model: dict[int, list[int]] = {}  # endpoint -> keys, least recent first
    for endpoint, keys in ops:
        index.record(endpoint, keys)
        held = model.setdefault(endpoint, [])
        for key in keys:
            if key in held:
                held.remove(key)
            held.append(key)
        del held[: max(0, len(held) - capacity)]
    mask = sum(1 << e for e in candidates)
    runs = [-1] * 6
    expected = brute_force_runs(model, query, candidates)
    assert index.runs(query, mask, runs) == max(expected.values(), default=0)
    assert {e: runs[e] for e in candidates if runs[e]} == expected
    assert all(runs[e] == (0 if e in candidates else -1) for e in range(6) if e not in expected)
    assert index.num_entries() == sum(len(v) for v in model.values())
    assert all(len(v) <= capacity for v in model.values())


def test_remove_endpoint_forgets_it() -> None:
    index = ApproximatePrefixIndex(10)
    index.record(0, [1, 2, 3])
    index.record(1, [1, 2])
    index.remove_endpoint(0)
    runs = [-1, -1]
    assert index.runs([1, 2, 3], 0b11, runs) == 2
    assert runs == [0, 2]
    index.remove_endpoint(1)
    assert len(index) == 0


def test_lookups_count_matched_blocks_for_the_hit_ratio() -> None:
    index = ApproximatePrefixIndex(10)
    index.record(0, [1, 2, 3])
    index.record(1, [1])
    runs: list[int] = []  # grown by the walk
    assert index.runs([1, 2, 3, 4], 0b11, runs) == 3
    assert runs == [3, 1]
    assert index.runs([9], 0b11, runs) == 0
    assert (index.lookups, index.queried_blocks, index.hit_blocks) == (2, 5, 3)
