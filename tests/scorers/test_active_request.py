"""active-request-scorer: the picker's own in-flight counts, relative to the busiest candidate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.decode import decode
from kv_picker.endpoint import ROLE_LABEL
from kv_picker.errors import ConfigError
from kv_picker.scheduling.signals import PREDICTED_COST, PREFIX_MATCH, PrefixMatch
from kv_picker.scorers.active_request import ActiveRequestParams, ActiveRequestScorer
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.hardware import HARDWARE_CLASS_LABEL
from tests.fakes import (
    ManualClock,
    make_context,
    make_director,
    make_request,
    make_scheduler,
    make_store,
    one_scorer_document,
)


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


def test_free_load_weighs_nothing_and_the_rest_counts_as_before() -> None:
    store = make_store(3)
    params = decode(ActiveRequestParams, {"unit": "tokens", "freeLoad": 16384}, "parameters")
    scorer = ActiveRequestScorer("a", params, make_context(store))
    store.in_flight_tokens[:3] = [0, 8000, 16000]  # light: every endpoint under the allowance
    assert scores(scorer, 3, store) == [1.0, 1.0, 1.0]
    store.in_flight_tokens[:3] = [0, 26384, 36384]  # past it: 10,000 and 20,000 count
    assert scores(scorer, 3, store) == pytest.approx([1.0, 0.5, 0.0])
    plain = ActiveRequestScorer("a", ActiveRequestParams(unit="tokens"), make_context(store))
    store.in_flight_tokens[:3] = [0, 8000, 16000]
    assert scores(plain, 3, store) == pytest.approx([1.0, 0.5, 0.0])


def test_free_load_on_a_mixed_pool_counts_after_the_decode_speed() -> None:
    store = _classed_store(["H100", "L4"])
    params = decode(
        ActiveRequestParams,
        {"unit": "tokens", "perHardware": True, "freeLoad": 5000},
        "parameters",
    )
    scorer = ActiveRequestScorer("a", params, make_context(store))
    store.in_flight_tokens[:2] = [4000, 400]  # type: ignore[attr-defined]
    out = [0.0, 0.0]
    scorer.score(make_request(), store.all(), out)  # type: ignore[attr-defined]
    # The L4's 400 tokens weigh like 4,464 on an H100: both under the allowance.
    assert out == [1.0, 1.0]
    store.in_flight_tokens[:2] = [4000, 1000]  # type: ignore[attr-defined]
    scorer.score(make_request(), store.all(), out)  # type: ignore[attr-defined]
    # 11,161 H100-equivalent tokens: 6,161 past the allowance, the busiest.
    assert out == pytest.approx([1.0, 0.0])


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


@pytest.mark.parametrize(
    ("field", "value"), [("idleThreshold", -1), ("freeLoad", -1.0), ("freeLoad", "lots")]
)
def test_a_negative_or_non_numeric_allowance_is_a_config_error(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        decode(ActiveRequestParams, {field: value}, "parameters")


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


def _classed_store(classes: list[str]) -> object:
    return make_store(len(classes), labels=[{HARDWARE_CLASS_LABEL: c} for c in classes])


def _per_hardware(store: object, own: bool) -> ActiveRequestScorer:
    params = ActiveRequestParams(unit="tokens", perHardware=True, ownDecode=own)
    return ActiveRequestScorer("a", params, make_context(store))  # type: ignore[arg-type]


def test_per_hardware_counts_tokens_in_the_endpoints_own_decode_time() -> None:
    store = _classed_store(["H100", "L4"])
    store.in_flight_tokens[:2] = [1000, 100]  # type: ignore[attr-defined]
    out = [0.0, 0.0]
    _per_hardware(store, own=False).score(make_request(), store.all(), out)  # type: ignore[attr-defined]
    # An L4 reads KV about eleven times slower: its 100 tokens weigh more than the H100's 1,000.
    assert out[1] == 0.0 and out[0] == pytest.approx(1.0 - 1000 / (100 / 0.0896), abs=0.01)


def test_own_decode_charges_a_slow_endpoint_for_the_request_being_placed() -> None:
    store = _classed_store(["H100", "L4"])
    store.in_flight_tokens[:2] = [20_000, 0]  # type: ignore[attr-defined]
    long_prompt = make_request("x" * 40_000)  # 10,000 tokens at 4 characters a token
    short_prompt = make_request("x" * 400)  # 100 tokens
    for own, request, l4_wins in (
        (False, long_prompt, True),  # without it an idle L4 is the best place for anything
        (True, long_prompt, False),  # ~100,000 H100-tokens of decode on the L4 against 20,000
        (True, short_prompt, True),  # ~1,000: a short request may still use the idle L4
    ):
        out = [0.0, 0.0]
        _per_hardware(store, own).score(request, store.all(), out)  # type: ignore[attr-defined]
        assert (out[1] > out[0]) is l4_wins, (own, len(request.prompt.text), out)


@given(
    st.sampled_from(["H100", "A100", "L4"]),
    st.lists(st.integers(min_value=0, max_value=200_000), min_size=1, max_size=6),
    st.integers(min_value=1, max_value=40_000),
)
def test_own_decode_changes_nothing_on_a_pool_of_one_class(
    hardware: str, loads: list[int], prompt_chars: int
) -> None:
    store = _classed_store([hardware] * len(loads))
    store.in_flight_tokens[: len(loads)] = loads  # type: ignore[attr-defined]
    request = make_request("y" * prompt_chars)
    plain, own = [0.0] * len(loads), [0.0] * len(loads)
    _per_hardware(store, own=False).score(request, store.all(), plain)  # type: ignore[attr-defined]
    _per_hardware(store, own=True).score(request, store.all(), own)  # type: ignore[attr-defined]
    assert own == plain


def test_step_tokens_charge_a_slow_class_its_fixed_step_without_flattening_the_rest() -> None:
    # Three H100s with 0 / 20,000 / 40,000 tokens in flight and an idle L4. Without stepTokens
    # the idle L4 scores best for a short request; with it, the L4's slower fixed step (114,400
    # token-equivalents on an H100, eleven times that on the L4) scores 0, and the H100s keep
    # the spread they have without the L4 among the candidates.
    store = _classed_store(["H100", "H100", "H100", "L4"])
    store.in_flight_tokens[:4] = [0, 20_000, 40_000, 0]  # type: ignore[attr-defined]
    request = make_request("x" * 400)
    plain = [0.0] * 4
    _per_hardware(store, own=True).score(request, store.all(), plain)  # type: ignore[attr-defined]
    assert plain[3] > plain[1]
    params = ActiveRequestParams(
        unit="tokens", perHardware=True, ownDecode=True, stepTokens=114_400
    )
    stepped = [0.0] * 4
    ActiveRequestScorer("a", params, make_context(store)).score(request, store.all(), stepped)  # type: ignore[arg-type, attr-defined]
    assert stepped[3] == 0.0
    assert stepped[:3] == pytest.approx(plain[:3])
    # One class: the term is 0 everywhere and nothing changes.
    same = _classed_store(["A100"] * 3)
    same.in_flight_tokens[:3] = [0, 5_000, 30_000]  # type: ignore[attr-defined]
    a, b = [0.0] * 3, [0.0] * 3
    _per_hardware(same, own=True).score(request, same.all(), a)  # type: ignore[attr-defined]
    ActiveRequestScorer("a", params, make_context(same)).score(request, same.all(), b)  # type: ignore[arg-type, attr-defined]
    assert a == b
    _refused(
        {"unit": "tokens", "perHardware": True, "stepTokens": 1000}, "stepTokens needs ownDecode"
    )


def _refused(parameters: dict[str, object], match: str) -> None:
    """An active-request-scorer with these parameters is a config error matching ``match``."""
    with pytest.raises(ConfigError, match=match):
        make_scheduler(one_scorer_document("active-request-scorer", parameters), make_store(2))


def test_own_decode_without_per_hardware_is_a_config_error() -> None:
    _refused({"ownDecode": True}, r"active-request-scorer.*ownDecode needs perHardware")


@pytest.mark.parametrize("per_hardware", [False, True])
def test_prompt_scale_damps_spreading_in_proportion_to_the_request_being_placed(
    per_hardware: bool,
) -> None:
    """One document-sized request in flight on the holder: a long question about it is spread
    only as far as that load compares with twice its own prompt; a short one as before."""
    store = _classed_store(["H100", "H100"])
    store.in_flight_tokens[:2] = [40_000, 0]  # type: ignore[attr-defined]
    params = ActiveRequestParams(
        unit="tokens", perHardware=per_hardware, fullScale=8192, promptScale=2
    )
    scorer = ActiveRequestScorer("a", params, make_context(store))  # type: ignore[arg-type]
    plain = ActiveRequestScorer(
        "a", ActiveRequestParams(unit="tokens", perHardware=per_hardware, fullScale=8192),
        make_context(store),  # type: ignore[arg-type]
    )  # fmt: skip
    long_question = make_request("x" * 160_000)  # 40,000 tokens: the scale is 80,000
    short_question = make_request("x" * 400)  # 100 tokens: the busiest's 40,000 sets the scale
    for request, expected, without in (
        (long_question, [0.5, 1.0], [0.0, 1.0]),
        (short_question, [0.0, 1.0], [0.0, 1.0]),
    ):
        out, base = [0.0, 0.0], [0.0, 0.0]
        scorer.score(request, store.all(), out)  # type: ignore[attr-defined]
        plain.score(request, store.all(), base)  # type: ignore[attr-defined]
        assert out == pytest.approx(expected) and base == pytest.approx(without)


def _matched(
    request: object, block_tokens: float, blocks: dict[int, int], total: int, capped: bool = False
) -> None:
    request.state[PREFIX_MATCH] = PrefixMatch(block_tokens, total, dict(blocks), capped)  # type: ignore[attr-defined]


def test_cached_scale_damps_spreading_by_what_moving_would_lose() -> None:
    """A question whose 40,000-token document endpoint 0 holds stays near it; a new document of
    the same length, held nowhere, spreads as a short request does."""
    store = _classed_store(["H100", "H100"])
    store.in_flight_tokens[:2] = [40_000, 0]  # type: ignore[attr-defined]
    params = ActiveRequestParams(unit="tokens", perHardware=True, fullScale=8192, cachedScale=2)
    scorer = ActiveRequestScorer("a", params, make_context(store))  # type: ignore[arg-type]
    cached_question = make_request("x" * 160_400)
    _matched(cached_question, 16.0, {0: 2500}, 2506)  # 40,000 tokens held: the scale is 80,000
    new_document = make_request("x" * 160_400)
    _matched(new_document, 16.0, {}, 2506)  # nobody holds it: the busiest's 40,000 sets it
    no_prefix_scorer = make_request("x" * 160_400)  # no match at all: as if nothing is held
    for request, expected in (
        (cached_question, [0.5, 1.0]),
        (new_document, [0.0, 1.0]),
        (no_prefix_scorer, [0.0, 1.0]),
    ):
        out = [0.0, 0.0]
        scorer.score(request, store.all(), out)  # type: ignore[attr-defined]
        assert out == pytest.approx(expected)


def test_light_cached_scale_replaces_cached_scale_while_the_pool_is_lightly_loaded() -> None:
    """The question above with ``lightCachedScale`` 8 below a load of 0.5: on an idle pool the
    scale is 8 x 40,000 held tokens, so the holder's 40,000 tokens in flight cost it an eighth;
    once both endpoints have a prefill pending (load 1, past the 2-second window's average), the
    scale is cachedScale's again. A P/D decode pool never counts as lightly loaded."""
    clock = ManualClock()
    store = make_store(2, labels=[{HARDWARE_CLASS_LABEL: "H100"}] * 2, clock=clock)
    store.in_flight_tokens[:2] = [40_000, 0]
    params = ActiveRequestParams(
        unit="tokens", perHardware=True, fullScale=8192, cachedScale=2,
        lightCachedScale=8, lightLoad=0.5, loadWindowSeconds=2,
    )  # fmt: skip
    scorer = ActiveRequestScorer("a", params, make_context(store))

    def scored() -> list[float]:
        request = make_request("x" * 160_400)
        _matched(request, 16.0, {0: 2500}, 2506)
        out = [0.0, 0.0]
        scorer.score(request, store.all(), out)
        return out

    assert scored() == pytest.approx([1 - 40_000 / 320_000, 1.0])
    for endpoint in store.all():
        store.add_prefill(endpoint.id, 1000.0)
    clock.advance(20.0)
    assert scored() == pytest.approx([0.5, 1.0])

    decode_pool = make_store(2, labels=[{ROLE_LABEL: "decode"}] * 2)
    decode_pool.in_flight_tokens[:2] = [40_000, 0]
    on_decode = ActiveRequestScorer("a", params, make_context(decode_pool))
    request = make_request("x" * 160_400)
    _matched(request, 16.0, {0: 2500}, 2506)
    out = [0.0, 0.0]
    on_decode.score(request, decode_pool.all(), out)
    assert out == pytest.approx([0.5, 1.0])


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"unit": "tokens", "cachedScale": 2, "lightCachedScale": 8}, "go together"),
        ({"unit": "tokens", "cachedScale": 2, "lightLoad": 0.2}, "go together"),
        ({"unit": "tokens", "lightCachedScale": 8, "lightLoad": 0.2}, "needs cachedScale"),
    ],
)
def test_light_cached_scale_is_refused_without_its_partners(
    document: dict[str, object], message: str
) -> None:
    _refused(document, message)


def test_cached_scale_takes_the_larger_scale_with_prompt_scale() -> None:
    store = make_store(2)
    store.in_flight_tokens[:2] = [60_000, 0]
    params = ActiveRequestParams(unit="tokens", promptScale=1, cachedScale=4)
    scorer = ActiveRequestScorer("a", params, make_context(store))
    request = make_request("x" * 160_000)  # 40,000 tokens: promptScale's scale is 40,000
    _matched(request, 16.0, {1: 1250}, 2500)  # 20,000 held by endpoint 1: cachedScale's 80,000
    out = [0.0, 0.0]
    scorer.score(request, store.all(), out)
    assert out == pytest.approx([0.25, 1.0])


def test_capped_match_is_whole_counts_a_match_that_reached_the_limit_as_the_whole_prompt() -> None:
    """A 60,000-token prompt whose first 2,048 blocks (32,768 tokens) endpoint 0 holds, with the
    rest never looked up: by default it counts 32,768 tokens held; with the option the whole
    prompt. A match short of the limit, or a prompt that ended at it, counts what it matched."""
    store = _classed_store(["H100", "H100"])
    store.in_flight_tokens[:2] = [60_000, 0]  # type: ignore[attr-defined]
    base = dict(unit="tokens", perHardware=True, fullScale=8192, cachedScale=2)
    whole = ActiveRequestScorer(
        "a",
        ActiveRequestParams(**base, cappedMatchIsWhole=True),
        make_context(store),  # type: ignore[arg-type]
    )
    plain = ActiveRequestScorer("a", ActiveRequestParams(**base), make_context(store))  # type: ignore[arg-type]
    reached = make_request("x" * 240_000)  # 60,000 tokens
    _matched(reached, 16.0, {0: 2048}, 2048, capped=True)
    short = make_request("x" * 240_000)  # the holder has 1,000 of the 2,048 blocks looked up
    _matched(short, 16.0, {0: 1000}, 2048, capped=True)
    ended = make_request("x" * 131_072)  # exactly 2,048 blocks: nothing past the limit
    _matched(ended, 16.0, {0: 2048}, 2048, capped=False)
    capped_scale = 1 - 60_000 / 65_536  # 60,000 in flight against 2 x 32,768 held
    for request, with_option, without in (
        (reached, [0.5, 1.0], [capped_scale, 1.0]),  # 2 x 60,000: the whole prompt
        (short, [0.0, 1.0], [0.0, 1.0]),  # 2 x 16,000 held: the busiest's 60,000 counts
        (ended, [capped_scale, 1.0], [capped_scale, 1.0]),
    ):
        out, base_out = [0.0, 0.0], [0.0, 0.0]
        whole.score(request, store.all(), out)  # type: ignore[attr-defined]
        plain.score(request, store.all(), base_out)  # type: ignore[attr-defined]
        assert out == pytest.approx(with_option) and base_out == pytest.approx(without)


def test_capped_match_is_whole_needs_cached_scale() -> None:
    _refused({"unit": "tokens", "cappedMatchIsWhole": True}, "cappedMatchIsWhole needs cachedScale")


@pytest.mark.parametrize("name", ["promptScale", "cachedScale"])
def test_the_prompt_scales_need_tokens(name: str) -> None:
    _refused({name: 2}, rf"active-request-scorer.*{name} needs unit: tokens")
    with pytest.raises(ConfigError, match=name):
        decode(ActiveRequestParams, {"unit": "tokens", name: -1}, "parameters")


def test_latency_band_zeroes_the_candidates_the_estimate_puts_past_it() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    params = decode(ActiveRequestParams, {"unit": "tokens", "latencyBand": 1.0}, "parameters")
    banded = ActiveRequestScorer("a", params, make_context(store))
    plain = ActiveRequestScorer("a", ActiveRequestParams(unit="tokens"), make_context(store))
    request = make_request()
    # Endpoint 0 is the fastest to the first token; 1 is three times slower, 2 exactly twice.
    request.state[PREDICTED_COST] = (store.all(), [0.1, 0.3, 0.2])
    out, base = [0.0] * 3, [0.0] * 3
    banded.score(request, store.all(), out)
    plain.score(request, store.all(), base)
    assert base == pytest.approx([0.0, 1.0, 2 / 3])
    # Past twice the fastest's TTFT, in-flight spreading gives nothing; at the band's edge and
    # within it the score is as without the option.
    assert out == pytest.approx([0.0, 0.0, 2 / 3])


def test_latency_band_without_the_estimate_changes_nothing() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    params = decode(ActiveRequestParams, {"unit": "tokens", "latencyBand": 0.5}, "parameters")
    banded = ActiveRequestScorer("a", params, make_context(store))
    request = make_request()
    out = [0.0] * 3
    banded.score(request, store.all(), out)  # no predicted-latency-scorer ran
    assert out == pytest.approx([0.0, 1.0, 2 / 3])
    other = make_store(9).all()[7:]
    request.state[PREDICTED_COST] = (other, [0.1, 0.1])  # another profile's candidates only
    banded.score(request, store.all(), out)
    assert out == pytest.approx([0.0, 1.0, 2 / 3])
    with pytest.raises(ConfigError, match="latencyBand"):
        decode(ActiveRequestParams, {"latencyBand": -0.5}, "parameters")


def test_latency_band_keeps_a_request_with_the_holder_the_estimate_prefers() -> None:
    # The latency scorer publishes its ranking cost, the in-flight scorer after it reads it: a
    # request whose context endpoint 0 holds stays there although endpoint 1 is idle, once
    # endpoint 1 is predicted past the band (it would prefill the whole context).
    def document(band: float) -> dict[str, object]:
        return {
            "plugins": [
                {"type": "prefix-cache-scorer", "parameters": {"maxPrefixBlocksToMatch": 2048}},
                {"type": "predicted-latency-scorer"},
                {
                    "type": "active-request-scorer",
                    "parameters": {"unit": "tokens", "latencyBand": band},
                },
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "prefix-cache-scorer", "weight": 1},
                        {"pluginRef": "predicted-latency-scorer", "weight": 1},
                        {"pluginRef": "active-request-scorer", "weight": 4},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        }

    stayed = {}
    for band in (0.0, 1.0):
        director = make_director(document(band), make_store(2))
        context = "the same long document, over and over. " * 2000
        first = director.route(make_request(context + "first question?", request_id="a"))
        first.first_byte()  # its holder now decodes that context; a question about it arrives
        second = director.route(make_request(context + "second question?", request_id="b"))
        stayed[band] = second.endpoint is first.endpoint
    assert stayed == {0.0: False, 1.0: True}


def _gated(store: object, load: float = 0.1, **extra: object) -> ActiveRequestScorer:
    fields = {"unit": "tokens", "latencyBand": 1.0, "latencyBandLoad": load, "maxNumSeqs": 4}
    params = decode(ActiveRequestParams, {**fields, **extra}, "parameters")
    return ActiveRequestScorer("a", params, make_context(store))  # type: ignore[arg-type]


def _banded_scores(scorer: ActiveRequestScorer, store: object) -> list[float]:
    request = make_request()
    # Endpoint 0 holds the request's context: three times faster to the first token.
    request.state[PREDICTED_COST] = (store.all(), [0.1, 0.3, 0.3])  # type: ignore[attr-defined]
    out = [0.0] * 3
    scorer.score(request, store.all(), out)  # type: ignore[attr-defined]
    return out


def test_latency_band_load_applies_the_band_only_on_a_lightly_loaded_pool() -> None:
    clock = ManualClock()
    store = make_store(3, clock=clock)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    scorer = _gated(store, load=0.2)
    # One request in flight of 4 slots on each of 3 endpoints: a load of 0.25.
    store.in_flight[:3] = [1, 1, 1]
    assert _banded_scores(scorer, store) == pytest.approx([0.0, 1.0, 2 / 3])
    # Ten seconds later the pool is idle; the moving average falls below 0.2 within a window.
    store.in_flight[:3] = [0, 0, 0]
    clock.advance(10.0)
    assert _banded_scores(scorer, store) == pytest.approx([0.0, 0.0, 0.0])


def test_latency_band_load_counts_the_share_with_a_prefill_pending() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    scorer = _gated(store, load=0.5)
    store.add_prefill(0, 1000)
    store.add_prefill(1, 1000)  # two of three candidates are prefilling: load 2/3
    assert _banded_scores(scorer, store) == pytest.approx([0.0, 1.0, 2 / 3])
    light = _gated(store, load=0.7)
    assert _banded_scores(light, store) == pytest.approx([0.0, 0.0, 0.0])


def test_latency_band_load_leaves_decode_pools_and_mixed_hardware_alone() -> None:
    decode_pool = make_store(3, labels=[{ROLE_LABEL: "decode"}] * 3)
    decode_pool.in_flight_tokens[:3] = [30000, 0, 10000]
    assert _banded_scores(_gated(decode_pool), decode_pool) == pytest.approx([0.0, 1.0, 2 / 3])
    classes = [{HARDWARE_CLASS_LABEL: c} for c in ("H100", "H100", "A100")]
    mixed = make_store(3, labels=classes)
    mixed.in_flight_tokens[:3] = [30000, 0, 10000]
    scorer = _gated(mixed, perHardware=True)
    plain = ActiveRequestScorer(
        "p", ActiveRequestParams(unit="tokens", perHardware=True), make_context(mixed)
    )
    assert _banded_scores(scorer, mixed) == pytest.approx(_banded_scores(plain, mixed))
    one_class = make_store(3, labels=[{HARDWARE_CLASS_LABEL: "H100"}] * 3)
    one_class.in_flight_tokens[:3] = [30000, 0, 10000]
    assert _banded_scores(_gated(one_class, perHardware=True), one_class) == pytest.approx(
        [0.0, 0.0, 0.0]
    )


@pytest.mark.parametrize(
    "field",
    ["latencyBandLoad", "latencyBandSlack", "latencyBandMinTokens", "latencyBandPromptTokens"],
)
def test_the_band_options_need_the_band(field: str) -> None:
    _refused({field: 0.1}, f"{field} needs latencyBand")


def test_the_band_options_take_values_in_range() -> None:
    bad = [("latencyBandLoad", 1.5), ("latencyBandLoad", -0.1), ("latencyBandSlack", -0.1),
           ("latencyBandMinTokens", -1), ("latencyBandPromptTokens", -1),
           ("heldMinTokens", -1)]  # fmt: skip
    for field, value in [*bad, ("maxNumSeqs", -1), ("loadWindowSeconds", 0)]:
        with pytest.raises(ConfigError, match=field):
            decode(ActiveRequestParams, {field: value}, "parameters")


def test_latency_band_slack_keeps_candidates_within_that_many_seconds() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    request = make_request()
    # Endpoint 0 is the fastest; 1 is 0.25 s behind it (3.5 times), 2 is 0.05 s behind.
    request.state[PREDICTED_COST] = (store.all(), [0.02, 0.27, 0.07])

    def scores(slack: float) -> list[float]:
        fields = {"unit": "tokens", "latencyBand": 1.0, "latencyBandSlack": slack}
        scorer = ActiveRequestScorer(
            "a", decode(ActiveRequestParams, fields, "parameters"), make_context(store)
        )
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    # The band alone (twice the fastest, 0.04 s) excludes both others.
    assert scores(0.0) == pytest.approx([0.0, 0.0, 0.0])
    # A slack of 0.1 s keeps endpoint 2 (0.05 s behind), not endpoint 1 (0.25 s behind).
    assert scores(0.1) == pytest.approx([0.0, 0.0, 2 / 3])
    # Past 0.25 s both are within it, as without the band.
    assert scores(0.3) == pytest.approx([0.0, 1.0, 2 / 3])


def _banded(**fields: object) -> tuple[EndpointStore, ActiveRequestScorer]:
    """Three endpoints with 30,000, 0 and 10,000 tokens in flight, and a scorer counting tokens
    with latencyBand 1 and ``fields``."""
    store = make_store(3)
    store.in_flight_tokens[:3] = [30000, 0, 10000]
    fields = {"unit": "tokens", "latencyBand": 1.0, **fields}
    scorer = ActiveRequestScorer(
        "a", decode(ActiveRequestParams, fields, "parameters"), make_context(store)
    )
    return store, scorer


def test_latency_band_min_tokens_applies_the_band_to_long_held_contexts_only() -> None:
    store, scorer = _banded(latencyBandMinTokens=16384)

    def scores(held_blocks: dict[int, int] | None) -> list[float]:
        request = make_request()
        # Endpoint 0 is predicted three times faster to the first token than the others.
        request.state[PREDICTED_COST] = (store.all(), [0.1, 0.3, 0.3])
        if held_blocks is not None:
            request.state[PREFIX_MATCH] = PrefixMatch(16, 2048, held_blocks)
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    unbanded = [0.0, 1.0, 2 / 3]
    assert scores(None) == pytest.approx(unbanded)  # no prefix scorer ran: nothing is held
    assert scores({0: 1023, 2: 10}) == pytest.approx(unbanded)  # 16,368 tokens: short of it
    assert scores({0: 1024}) == pytest.approx([0.0, 0.0, 0.0])  # 16,384: the band applies
    assert scores({2: 1500}) == pytest.approx([0.0, 0.0, 0.0])  # whichever candidate holds it


def test_latency_band_prompt_tokens_applies_the_band_to_long_prompts_held_or_not() -> None:
    # Endpoint 1 has the fewest tokens in flight but a long prefill queued: the latency
    # estimate puts it three times slower to the first token than the others.
    store, scorer = _banded(latencyBandPromptTokens=16384)

    def scores(tokens: int) -> list[float]:
        request = make_request("x" * 4 * tokens)  # cached nowhere: a new document
        request.state[PREDICTED_COST] = (store.all(), [0.1, 0.3, 0.1])
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    assert scores(16383) == pytest.approx([0.0, 1.0, 2 / 3])  # short of it: no band
    # From 16,384 tokens on the band applies, though no candidate holds any of the prompt.
    assert scores(16384) == pytest.approx([0.0, 0.0, 2 / 3])


def test_held_is_free_counts_in_flight_tokens_less_what_the_candidate_holds() -> None:
    store = make_store(3)
    # Endpoint 0 is prefilling a 50,000-token document; a question about it arrives.
    store.in_flight_tokens[:3] = [50000, 0, 10000]

    def scores(free: bool, held_blocks: dict[int, int] | None) -> list[float]:
        fields = {"unit": "tokens", "heldIsFree": free}
        scorer = ActiveRequestScorer(
            "a", decode(ActiveRequestParams, fields, "parameters"), make_context(store)
        )
        request = make_request()
        if held_blocks is not None:
            request.state[PREFIX_MATCH] = PrefixMatch(16, 3200, held_blocks)
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    assert scores(False, {0: 3125}) == pytest.approx([0.0, 1.0, 0.8])
    # The document's 50,000 tokens are the work the question needs: endpoint 0 counts as idle,
    # and the busiest candidate is now endpoint 2.
    assert scores(True, {0: 3125}) == pytest.approx([1.0, 1.0, 0.0])
    # What a candidate holds counts up to its own tokens in flight, never below zero.
    assert scores(True, {0: 1000, 2: 3000}) == pytest.approx([0.0, 1.0, 1.0])
    assert scores(True, None) == pytest.approx(scores(False, None))  # no prefix scorer ran
    _refused({"heldIsFree": True, "unit": "requests"}, "heldIsFree needs unit: tokens")


def test_held_pending_only_relieves_a_holder_while_it_computes_the_context() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [50000, 0, 10000]
    fields = {"unit": "tokens", "heldIsFree": True, "heldPendingOnly": True}
    scorer = ActiveRequestScorer(
        "a", decode(ActiveRequestParams, fields, "parameters"), make_context(store)
    )

    def scores() -> list[float]:
        request = make_request()
        request.state[PREFIX_MATCH] = PrefixMatch(16, 3200, {0: 3125})  # 50,000 tokens held
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    # The document is still being prefilled on endpoint 0: its tokens count as free there.
    store.prefill_tokens[:3] = [50000.0, 0.0, 0.0]
    assert scores() == pytest.approx([1.0, 1.0, 0.0])
    # Part of it is left to compute: only that part is free.
    store.prefill_tokens[0] = 20000.0
    assert scores() == pytest.approx([0.0, 1.0, 1 - 10000 / 30000])
    # Cached and decoding: it counts in full, as without the option.
    store.prefill_tokens[0] = 0.0
    assert scores() == pytest.approx([0.0, 1.0, 0.8])
    _refused({"heldPendingOnly": True, "unit": "tokens"}, "heldPendingOnly needs heldIsFree")


def test_held_min_tokens_applies_held_is_free_to_long_held_contexts_only() -> None:
    store = make_store(3)
    store.in_flight_tokens[:3] = [50000, 0, 10000]
    fields = {"unit": "tokens", "heldIsFree": True, "heldMinTokens": 32768}
    scorer = ActiveRequestScorer(
        "a", decode(ActiveRequestParams, fields, "parameters"), make_context(store)
    )

    def scores(blocks: int) -> list[float]:
        request = make_request()
        request.state[PREFIX_MATCH] = PrefixMatch(16, 3200, {0: blocks})
        out = [0.0] * 3
        scorer.score(request, store.all(), out)
        return out

    assert scores(2047) == pytest.approx([0.0, 1.0, 0.8])  # 32,752 tokens held: as without it
    assert scores(2048) == pytest.approx([0.0, 1.0, 1 - 10000 / 17232])  # 32,768: 17,232 left
    _refused({"heldMinTokens": 100, "unit": "tokens"}, "heldMinTokens needs heldIsFree")
