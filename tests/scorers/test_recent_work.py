"""recent-work-scorer: decayed prefill work per endpoint, from the picker's own picks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.decode import decode
from kv_picker.endpoint import EndpointId, EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.scheduling.signals import PREFIX_MATCH, PROMPT_TOKENS, PrefixMatch
from kv_picker.scorers.recent_work import RecentWorkParams, RecentWorkScorer
from kv_picker.state.endpoints import RECENT_WORK_TIME_CONSTANT_S
from kv_picker.state.hardware import HARDWARE_CLASS_LABEL
from tests.fakes import ManualClock, make_context, make_director, make_request, make_store


def scores(scorer: RecentWorkScorer, store: object) -> list[float]:
    candidates = store.all()  # type: ignore[attr-defined]
    out = [0.0] * len(candidates)
    scorer.score(make_request(), candidates, out)
    return out


def test_work_decays_with_its_age_and_adds_up() -> None:
    clock = ManualClock()
    store = make_store(2, clock=clock)
    store.add_recent_prefill(0, 1000.0, 2e6)
    assert store.recent_prefill(0) == (1000.0, 2e6)
    clock.advance(RECENT_WORK_TIME_CONSTANT_S)
    tokens, pairs = store.recent_prefill(0)
    assert tokens == pytest.approx(1000.0 / math.e) and pairs == pytest.approx(2e6 / math.e)
    store.add_recent_prefill(0, 500.0, 0.0)
    assert store.recent_prefill(0)[0] == pytest.approx(1000.0 / math.e + 500.0)
    clock.advance(20 * RECENT_WORK_TIME_CONSTANT_S)
    assert store.recent_prefill(0)[0] < 1e-5
    assert store.recent_prefill(1) == (0.0, 0.0)  # never sent anything


def test_work_read_as_of_a_given_time_is_the_work_the_clock_would_give_then() -> None:
    clock = ManualClock()
    store = make_store(1, clock=clock)
    store.add_recent_prefill(0, 1000.0, 2e6)
    later = clock() + RECENT_WORK_TIME_CONSTANT_S
    as_of_later = store.recent_prefill(0, later)
    assert as_of_later[0] == pytest.approx(1000.0 / math.e)
    assert store.recent_prefill(0) == (1000.0, 2e6)  # the clock itself has not moved
    clock.advance(RECENT_WORK_TIME_CONSTANT_S)
    assert store.recent_prefill(0) == as_of_later


def test_a_queued_prefill_counts_and_stays_after_it_ends() -> None:
    store = make_store(1)
    store.add_prefill(0, 800.0, 3e5)
    store.prefill_done(0, 800.0, 3e5)
    assert store.prefill_tokens[0] == 0.0  # nothing queued any more
    assert store.recent_prefill(0) == (800.0, 3e5)  # but the endpoint did the work


def test_an_endpoint_id_reused_starts_with_no_work() -> None:
    store = make_store(2)
    store.add_recent_prefill(1, 5000.0, 0.0)
    store.set_endpoints([EndpointSpec("10.0.0.1:8000")])
    store.set_endpoints([EndpointSpec("10.0.0.1:8000"), EndpointSpec("10.0.0.9:8000")])
    newcomer = store.by_address["10.0.0.9:8000"]
    assert newcomer.id == 1  # the id was reused
    assert store.recent_prefill(newcomer.id) == (0.0, 0.0)


def test_scores_relative_to_the_busiest_with_attention_and_a_full_scale() -> None:
    store = make_store(3)
    scorer = RecentWorkScorer("w", RecentWorkParams(), make_context(store))
    assert scores(scorer, store) == [1.0, 1.0, 1.0]  # nobody worked: no division by zero
    store.add_recent_prefill(1, 10_000.0, 0.0)
    store.add_recent_prefill(2, 10_000.0, 20_500.0 * 10_000.0)  # attention: as much again
    assert scores(scorer, store) == pytest.approx([1.0, 0.5, 0.0])
    tokens_only = RecentWorkScorer(
        "w", RecentWorkParams(attentionCrossoverTokens=0), make_context(store)
    )
    assert scores(tokens_only, store) == pytest.approx([1.0, 0.0, 0.0])
    damped = RecentWorkScorer("w", RecentWorkParams(fullScale=100_000.0), make_context(store))
    assert scores(damped, store) == pytest.approx([1.0, 0.9, 0.8])


def test_an_idle_share_scores_only_the_endpoints_left_idle() -> None:
    store = make_store(4)
    for i, tokens in enumerate([0.0, 1_000.0, 30_000.0, 40_000.0]):
        store.add_recent_prefill(i, tokens, 0.0)
    params = RecentWorkParams(attentionCrossoverTokens=0, idleShare=0.25)
    seeding = RecentWorkScorer("w", params, make_context(store))
    assert scores(seeding, store) == pytest.approx([1.0, 0.9, 0.0, 0.0])
    # A pool busy everywhere: no endpoint did under a quarter of the busiest one's work.
    busy = make_store(3)
    for i, tokens in enumerate([20_000.0, 30_000.0, 40_000.0]):
        busy.add_recent_prefill(i, tokens, 0.0)
    assert scores(RecentWorkScorer("w", params, make_context(busy)), busy) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="idleShare"):
        decode(RecentWorkParams, {"idleShare": 0}, "parameters")


def test_work_is_counted_in_the_endpoints_own_prefill_time() -> None:
    store = make_store(2, labels=[{HARDWARE_CLASS_LABEL: "H100"}, {HARDWARE_CLASS_LABEL: "L4"}])
    scorer = RecentWorkScorer("w", RecentWorkParams(), make_context(store))
    store.add_recent_prefill(0, 10_000.0, 0.0)
    store.add_recent_prefill(1, 10_000.0, 0.0)
    # The same tokens keep an L4 busy about eight times longer than an H100.
    h100, l4 = scores(scorer, store)
    assert l4 == 0.0 and h100 == pytest.approx(1.0 - 0.122, abs=0.01)


def test_new_contexts_spread_over_idle_endpoints_and_return_once_the_work_is_forgotten() -> None:
    clock = ManualClock()
    document = {
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "recent-work-scorer"},
            {"type": "max-score-picker"},
        ],
    }
    director = make_director(document, store=make_store(3, clock=clock))
    used = []
    for i in range(3):
        # Each request finishes before the next arrives: nothing queued or in flight remains.
        routed = director.route(make_request(f"document {i} " * 200, request_id=str(i)))
        routed.first_byte()
        routed.finish()
        used.append(routed.endpoint.id)
        clock.advance(1.0)
    assert sorted(used) == [0, 1, 2]
    assert director.store.prefill_tokens[:3] == [0.0, 0.0, 0.0]
    # Much later the work is forgotten; a context held by one endpoint goes back there.
    clock.advance(30 * RECENT_WORK_TIME_CONSTANT_S)
    again = director.route(make_request("document 1 " * 200, request_id="again"))
    assert again.endpoint.id == used[1]


def test_negative_parameters_are_config_errors_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="fullScale"):
        decode(RecentWorkParams, {"fullScale": -1}, "parameters")
    with pytest.raises(ConfigError, match="attentionCrossoverTokens"):
        decode(RecentWorkParams, {"attentionCrossoverTokens": "many"}, "parameters")


@given(st.lists(st.floats(min_value=0, max_value=1e7), min_size=1, max_size=8))
def test_scores_are_in_unit_range_and_ordered_by_work(work: list[float]) -> None:
    store = make_store(len(work))
    for i, tokens in enumerate(work):
        store.add_recent_prefill(i, tokens, 0.0)
    out = scores(RecentWorkScorer("w", RecentWorkParams(), make_context(store)), store)
    assert all(0.0 <= s <= 1.0 for s in out)
    for i in range(len(work)):
        for j in range(len(work)):
            if work[i] < work[j]:
                assert out[i] >= out[j]


def test_decode_speed_scaling_seeds_a_slow_idle_endpoint_less() -> None:
    labels = [{HARDWARE_CLASS_LABEL: c} for c in ("H100", "H100", "L4")]
    store = make_store(3, labels=labels)
    store.add_recent_prefill(0, 40_000.0, 0.0)
    plain = RecentWorkScorer("w", RecentWorkParams(idleShare=0.25), make_context(store))
    assert scores(plain, store) == [0.0, 1.0, 1.0]
    params = RecentWorkParams(idleShare=0.25, decodeSpeedScaled=True)
    scaled = RecentWorkScorer("w", params, make_context(store))
    busy, idle_h100, idle_l4 = scores(scaled, store)
    assert busy == 0.0 and idle_h100 == 1.0
    assert idle_l4 == pytest.approx(0.300 / 3.35, rel=0.01)
    # Nobody worked yet: the same proportion.
    fresh = make_store(3, labels=labels)
    scaled_fresh = RecentWorkScorer("w", params, make_context(fresh))
    assert scores(scaled_fresh, fresh)[2] == pytest.approx(0.300 / 3.35, rel=0.01)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_decode_speed_scaled_takes_only_a_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match=r"parameters\.decodeSpeedScaled: expected true/false"):
        decode(RecentWorkParams, {"decodeSpeedScaled": value}, "parameters")


@pytest.mark.parametrize(
    ("held_tokens", "factor"),
    [(0, 1.0), (250, 0.75), (1000, 0.0)],
    ids=["new context", "a quarter held", "all held"],
)
def test_match_scaled_seeds_with_the_share_of_the_prompt_no_candidate_holds(
    held_tokens: int, factor: float
) -> None:
    store = make_store(3)
    store.add_recent_prefill(2, 10_000.0, 0.0)
    plain = RecentWorkScorer("w", RecentWorkParams(idleShare=0.5), make_context(store))
    scaled = RecentWorkScorer(
        "w", RecentWorkParams(idleShare=0.5, matchScaled=True), make_context(store)
    )
    request = make_request()
    request.state[PROMPT_TOKENS] = 1000
    # Endpoint 2 holds the prefix in every case but the first; the best holder counts.
    matched = {EndpointId(0): 2, EndpointId(2): held_tokens // 10} if held_tokens else {}
    request.state[PREFIX_MATCH] = PrefixMatch(10, 100, matched)
    candidates = store.all()
    out_plain, out_scaled = [0.0] * 3, [0.0] * 3
    plain.score(request, candidates, out_plain)
    scaled.score(request, candidates, out_scaled)
    assert out_plain == pytest.approx([1.0, 1.0, 0.0])
    assert out_scaled == pytest.approx([s * factor for s in out_plain])


def test_match_scaled_without_a_prefix_match_is_the_plain_score() -> None:
    store = make_store(2)
    store.add_recent_prefill(1, 10_000.0, 0.0)
    scaled = RecentWorkScorer("w", RecentWorkParams(matchScaled=True), make_context(store))
    assert scores(scaled, store) == pytest.approx([1.0, 0.0])  # no prefix scorer ran


def test_match_scaled_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="matchScaled"):
        decode(RecentWorkParams, {"matchScaled": "sometimes"}, "parameters")
    assert decode(RecentWorkParams, {"matchScaled": True}, "parameters").matchScaled is True
