"""The one leading-run walk against a brute-force model, overlay and buffer growth included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.endpoint import EndpointSpec
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.prefix_runs import leading_runs, mask_of

NUM_ENDPOINTS = 7
KEYS = st.integers(0, 9)
bitsets = st.dictionaries(KEYS, st.integers(1, 2**NUM_ENDPOINTS - 1), max_size=10)


def brute_force(
    holders: list[dict[int, int]], keys: list[int], candidates: set[int]
) -> dict[int, int]:
    """Per candidate: count leading keys that some map says it holds."""
    runs = {}
    for endpoint in candidates:
        run = 0
        for key in keys:
            if not any(m.get(key, 0) >> endpoint & 1 for m in holders):
                break
            run += 1
        runs[endpoint] = run
    return runs


@settings(max_examples=500)
@given(
    bitsets,
    st.none() | st.tuples(bitsets, bitsets),
    st.lists(KEYS, max_size=12),
    st.sets(st.integers(0, NUM_ENDPOINTS - 1)),
    st.integers(0, NUM_ENDPOINTS + 2),
)
def test_matches_brute_force(
    holders: dict[int, int],
    overlay: tuple[dict[int, int], dict[int, int]] | None,
    keys: list[int],
    candidates: set[int],
    buffer_size: int,
) -> None:
    runs_out = [-1] * buffer_size  # may be too short: the walk grows it
    best = leading_runs(keys, sum(1 << e for e in candidates), runs_out, holders, overlay)
    expected = brute_force([holders, *(overlay or ())], keys, candidates)
    assert {e: runs_out[e] for e in candidates} == expected
    assert best == max(expected.values(), default=0)
    # Entries of other endpoints are untouched (or zero where the buffer grew).
    assert len(runs_out) >= max(candidates, default=-1) + 1
    for e in range(len(runs_out)):
        if e not in candidates:
            assert runs_out[e] == (-1 if e < buffer_size else 0)


def test_a_full_match_and_no_candidates() -> None:
    runs = [0, 0, 0]
    assert leading_runs([1, 2], 0b101, runs, {1: 0b111, 2: 0b111}) == 2
    assert runs == [2, 0, 2]
    assert leading_runs([1, 2], 0, runs, {1: 0b111}) == 0
    assert runs == [2, 0, 2]
    assert leading_runs([], 0b11, runs, {}) == 0
    assert runs == [0, 0, 2]


def test_mask_of_endpoints() -> None:
    store = EndpointStore(lambda: 0.0)
    store.set_endpoints(EndpointSpec(f"10.0.0.{i}:8000") for i in range(1, 5))
    assert mask_of([store.all()[3], store.all()[1]]) == 0b1010
    assert mask_of([]) == 0
