"""active-request-scorer: the picker's own in-flight counts, relative to the busiest candidate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.decode import decode
from kv_picker.errors import ConfigError
from kv_picker.scorers.active_request import ActiveRequestParams, ActiveRequestScorer
from tests.fakes import make_context, make_director, make_request, make_store


def scores(scorer: ActiveRequestScorer, store_size: int, store: object) -> list[float]:
    out = [0.0] * store_size
    scorer.score(make_request(), store.all(), out)  # type: ignore[attr-defined]
    return out


def test_fewer_in_flight_scores_higher_relative_to_the_busiest() -> None:
    store = make_store(4)
    store.in_flight[:4] = [0, 1, 2, 4]
    scorer = ActiveRequestScorer("a", ActiveRequestParams(), make_context(store))
    assert scores(scorer, 4, store) == [1.0, 0.75, 0.5, 0.0]


def test_idle_threshold_and_an_idle_pool() -> None:
    store = make_store(3)
    scorer = ActiveRequestScorer("a", ActiveRequestParams(idleThreshold=1), make_context(store))
    store.in_flight[:3] = [0, 1, 3]
    assert scores(scorer, 3, store) == pytest.approx([1.0, 1.0, 0.0])
    store.in_flight[:3] = [0, 0, 0]  # nobody busy: no division by zero, everyone idle
    plain = ActiveRequestScorer("a", ActiveRequestParams(), make_context(store))
    assert scores(plain, 3, store) == [1.0, 1.0, 1.0]


def test_full_scale_damps_differences_on_a_lightly_loaded_pool() -> None:
    store = make_store(3)
    params = decode(ActiveRequestParams, {"unit": "tokens", "fullScale": 100000}, "parameters")
    scorer = ActiveRequestScorer("a", params, make_context(store))
    store.in_flight_tokens[:3] = [0, 20000, 40000]  # light: below the scale
    assert scores(scorer, 3, store) == pytest.approx([1.0, 0.8, 0.6])
    store.in_flight_tokens[:3] = [0, 100000, 200000]  # heavy: relative to the busiest again
    assert scores(scorer, 3, store) == pytest.approx([1.0, 0.5, 0.0])
    plain = ActiveRequestScorer("a", ActiveRequestParams(unit="tokens"), make_context(store))
    store.in_flight_tokens[:3] = [0, 20000, 40000]
    assert scores(plain, 3, store) == pytest.approx([1.0, 0.5, 0.0])


def test_it_follows_the_directors_picks_and_releases() -> None:
    director = make_director(
        {
            "plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"}],
        },
        store=make_store(2),
    )
    first = director.route(make_request(request_id="a"))
    second = director.route(make_request(request_id="b"))
    assert first.endpoint is not second.endpoint  # the first pick made its endpoint busier
    first.finish()
    third = director.route(make_request(request_id="c"))
    assert third.endpoint is first.endpoint  # released: idle again
    first.finish()  # idempotent: no count goes below zero
    assert min(director.store.in_flight[:2]) >= 0


def test_negative_threshold_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="idleThreshold"):
        decode(ActiveRequestParams, {"idleThreshold": -1}, "parameters")


@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8))
def test_scores_are_in_unit_range_and_ordered_by_load(loads: list[int]) -> None:
    store = make_store(len(loads))
    store.in_flight[: len(loads)] = loads
    scorer = ActiveRequestScorer("a", ActiveRequestParams(), make_context(store))
    out = scores(scorer, len(loads), store)
    assert all(0.0 <= s <= 1.0 for s in out)
    for i in range(len(loads)):
        for j in range(len(loads)):
            if loads[i] < loads[j]:
                assert out[i] >= out[j]
