import dataclasses
import math
from typing import Any

import pytest

from kv_picker.decode import decode
from kv_picker.endpoint import EndpointId, EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.scheduling.framework import ProfileResult, SchedulingResult
from kv_picker.scheduling.signals import PREFIX_MATCH, PrefixMatch
from kv_picker.scorers.hardware_class import HardwareClassParams, HardwareClassScorer
from kv_picker.scorers.load_aware import LoadAwareParams, LoadAwareScorer
from kv_picker.scorers.lora_affinity import LoraAffinityParams, LoraAffinityScorer
from kv_picker.scorers.predicted_latency import (
    PredictedLatencyParams,
    PredictedLatencyScorer,
    fit_terms,
)
from kv_picker.scorers.session_affinity import (
    SessionAffinityParams,
    SessionAffinityScorer,
    decode_session_token,
    encode_session_token,
)
from kv_picker.state.endpoints import PREFILL_SAMPLES, LoraState
from kv_picker.state.hardware import (
    BUILTIN_HARDWARE_CLASSES,
    HARDWARE_CLASS_LABEL,
    HardwareTable,
)
from tests.fakes import (
    ManualClock,
    make_context,
    make_request,
    make_scheduler,
    make_store,
    one_scorer_document,
)


def scores(scorer, store, request=None) -> list[float]:  # type: ignore[no-untyped-def]
    out = [0.0] * len(store.all())
    scorer.score(request or make_request(), store.all(), out)
    return out


def classed(*names: str):  # type: ignore[no-untyped-def]
    return make_store(len(names), labels=[{HARDWARE_CLASS_LABEL: n} if n else {} for n in names])


def test_hardware_class_relative_to_fastest_candidate() -> None:
    store = classed("H100", "A100", "L4", "")
    prefill = HardwareClassScorer("h", HardwareClassParams("prefill"), make_context(store))
    assert scores(prefill, store) == pytest.approx([1.0, 0.315, 0.122, 1.0])
    decode = HardwareClassScorer(
        "h", HardwareClassParams("decode"), make_context(classed("H200", "H100"))
    )
    assert scores(decode, classed("H200", "H100")) == pytest.approx([1.0, 1.0 / 1.433], rel=1e-3)
    mig = classed("1g.10gb", "H100-MIG-3g.40gb")
    both = HardwareClassScorer("h", HardwareClassParams(), make_context(mig))
    first, second = scores(both, mig)
    assert second == 1.0 and first < 0.5


def test_hardware_table_overrides_and_default() -> None:
    from kv_picker.state.hardware import HardwareClass

    table = HardwareTable({"MI300X": HardwareClass("MI300X", 1.3, 1.6, 2.4)}, default_class="A100")
    assert table.of({HARDWARE_CLASS_LABEL: "MI300X"}).decode_speed == 1.6
    assert table.of({}).name == "A100"
    assert table.of({HARDWARE_CLASS_LABEL: "unknown"}).name == "A100"
    with pytest.raises(ValueError):
        HardwareTable(default_class="nope")


def test_load_aware() -> None:
    store = make_store(4, waiting=[0, 64, 128, 500])
    scorer = LoadAwareScorer("l", LoadAwareParams(threshold=128), make_context(store))
    assert scores(scorer, store) == [0.5, 0.25, 0.0, 0.0]


def test_lora_affinity_levels() -> None:
    store = make_store(4)
    states = [
        LoraState(frozenset({"sql"}), frozenset(), 2),
        LoraState(frozenset({"chat"}), frozenset(), 2),
        LoraState(frozenset({"a", "b"}), frozenset({"sql"}), 2),
        LoraState(frozenset({"a", "b"}), frozenset(), 2),
    ]
    for endpoint, state in zip(store.all(), states, strict=True):
        store.lora[endpoint.id] = state
    scorer = LoraAffinityScorer("l", LoraAffinityParams(), make_context(store))
    assert scores(scorer, store, make_request(model="sql")) == [1.0, 0.8, 0.6, 0.0]
    # A model no endpoint knows as an adapter is a base model: no preference.
    assert scores(scorer, store, make_request(model="base")) == [1.0] * 4
    declared = make_request(model="chat", lora_adapter="chat", target_model="base")
    assert scores(scorer, store, declared) == [0.8, 1.0, 0.0, 0.0]


def test_session_affinity_token_roundtrip_and_garbage() -> None:
    store = make_store(3)
    scorer = SessionAffinityScorer("s", SessionAffinityParams(), make_context(store))
    token = encode_session_token("10.0.0.2:8000")
    assert decode_session_token(token) == "10.0.0.2:8000"
    request = make_request(headers={"x-session-token": token})
    assert scores(scorer, store, request) == [0.0, 1.0, 0.0]
    for garbage in ("!!!", encode_session_token("10.9.9.9:1"), ""):
        assert (
            scores(scorer, store, make_request(headers={"x-session-token": garbage})) == [0.0] * 3
        )
    endpoint = store.all()[2]
    assert scorer.response_headers(request, endpoint) == [
        ("x-session-token", encode_session_token("10.0.0.3:8000"))
    ]


def linear_latency(**params: object) -> PredictedLatencyParams:
    """Latency parameters with the linear terms only: 1,000 prefill tokens/s, 0.5 s per
    unmatched waiting request, no attention, no step or KV-read cost (plus ``params``)."""
    return dataclasses.replace(
        PredictedLatencyParams(
            prefillTokensPerSecond=1000,
            queuedRequestSeconds=0.5,
            attentionCrossoverTokens=0,
            stepSeconds=0,
            kvReadTokensPerSecond=0,
        ),
        **params,
    )


def test_predicted_latency_combines_cache_queue_and_hardware() -> None:
    store = classed("H100", "H100", "L4")
    store.waiting[0] = 4  # a queue on the first H100
    params = linear_latency()
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    request = make_request("x" * 4000)  # ~1000 tokens
    request.state[PREFIX_MATCH] = PrefixMatch(16, 62, {EndpointId(2): 62})  # L4 holds it all
    ttft = [scorer.predict_ttft_s(request, e) for e in store.all()]
    assert ttft[0] == pytest.approx(4 * 0.5 + 1.0)
    assert ttft[1] == pytest.approx(1.0)
    assert ttft[2] == pytest.approx((1000 - 992) / (1000 * 0.122))
    out = scores(scorer, store, request)
    assert out[2] == 1.0 and out[1] == pytest.approx(ttft[2] / 1.0) and out[0] < out[1]


def test_predicted_latency_counts_queued_tokens_not_requests() -> None:
    store = make_store(2)
    first, second = store.all()
    store.add_prefill(first.id, 100_000)  # one huge prompt queued
    for _ in range(10):
        store.add_prefill(second.id, 500)  # ten small ones
    store.waiting[first.id], store.waiting[second.id] = 1, 10
    scorer = PredictedLatencyScorer("p", PredictedLatencyParams(), make_context(store))
    out = scores(scorer, store, make_request("x" * 4000))
    assert out[1] == 1.0 and out[0] < 0.1
    store.prefill_done(first.id, 100_000)
    assert store.prefill_tokens[first.id] == 0.0 and store.prefill_requests[first.id] == 0


def test_predicted_latency_attention_steps_and_decode_pressure() -> None:
    store = make_store(2)
    first, second = store.all()
    params = PredictedLatencyParams(
        prefillTokensPerSecond=10_000,
        attentionCrossoverTokens=10_000,
        stepSeconds=0.01,
        kvReadTokensPerSecond=1_000_000,
        chunkTokens=4096,
    )
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    short, long = make_request("x" * 4 * 5_000), make_request("x" * 4 * 20_000)
    # Attention: four times the prompt costs more than four times as much (plus steps).
    t_short = scorer.predict_ttft_s(short, first)
    t_long = scorer.predict_ttft_s(long, first)
    assert t_short == pytest.approx(0.5 + 5_000 * 2_500 / 1e8 + 2 * 0.01)
    assert t_long == pytest.approx(2.0 + 20_000 * 10_000 / 1e8 + 5 * 0.01)
    assert t_long > 4 * t_short
    # Queued attention work counts too, and requests in flight slow every step.
    store.add_prefill(first.id, 5_000, 5_000 * 2_500)
    assert scorer.predict_ttft_s(short, first) == pytest.approx(2 * 0.625 + 3 * 0.01)
    store.in_flight_tokens[second.id] = 50_000  # 50 ms more per step
    assert scorer.predict_ttft_s(short, second) == pytest.approx(0.625 + 2 * 0.06)


def test_predicted_latency_remote_prefill_costs_a_decode_endpoint_its_steps_only() -> None:
    # The decode profile of a P/D configuration: a prompt with at least remotePrefillTokens
    # uncached tokens is prefilled on a prefill endpoint, so at a decode endpoint it costs the
    # KV transfer and the decode steps (slowed by the KV already in flight there), not a prefill.
    store = make_store(2)
    holder, other = store.all()
    params = PredictedLatencyParams(
        prefillTokensPerSecond=10_000,
        attentionCrossoverTokens=0,
        stepSeconds=0.01,
        kvReadTokensPerSecond=1_000_000,
        transferSecondsPerToken=1e-6,
        remotePrefillTokens=1_024,
    )
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    request = make_request("x" * 4 * 20_000)  # 20,000 tokens
    request.state[PREFIX_MATCH] = PrefixMatch(16, 1250, {holder.id: 1250})  # all cached there
    store.add_prefill(other.id, 50_000)  # prefill work counted here does not delay a decode leg
    store.in_flight_tokens[holder.id] = 100_000  # 100 ms more per step: a busy decoder
    assert scorer.predict_ttft_s(request, other) == pytest.approx(0.01 + 20_000 * 1e-6)
    assert scorer.predict_ttft_s(request, holder) == pytest.approx(0.11)
    assert scores(scorer, store, request) == pytest.approx([0.03 / 0.11, 1.0])
    # Without it, the uncached prompt is prefill on the endpoint: the holder wins by far.
    local = PredictedLatencyScorer(
        "p", dataclasses.replace(params, remotePrefillTokens=0), make_context(store)
    )
    assert scorer.predict_ttft_s(request, other) < 0.05 < local.predict_ttft_s(request, other)
    assert scores(local, store, request)[0] == 1.0
    # Below the threshold the handler keeps the request aggregated: the endpoint prefills it.
    short = make_request("x" * 4 * 1_000)  # 1,000 uncached tokens < 1,024
    assert scorer.predict_ttft_s(short, holder) == pytest.approx(
        local.predict_ttft_s(short, holder)
    )
    assert scorer.predict_ttft_s(short, holder) > 0.1 + 0.11


def slot_params(**params: Any) -> PredictedLatencyParams:
    """Linear prefill at 10,000 tokens/s, 10 ms steps, no KV-read term (plus ``params``)."""
    return PredictedLatencyParams(
        prefillTokensPerSecond=10_000,
        attentionCrossoverTokens=0,
        stepSeconds=0.01,
        kvReadTokensPerSecond=0,
        **params,
    )


def test_predicted_latency_waits_for_a_free_sequence_slot() -> None:
    store = make_store(2)
    full, free = store.all()
    params = slot_params(maxNumSeqs=4, outputTokens=100)
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    request = make_request("x" * 4 * 1_000)  # 1,000 tokens: 0.1 s of prefill, one step
    base = 0.1 + 0.01
    store.in_flight[full.id] = 3  # this request takes the last slot: no wait
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base)
    # Two requests past the cap: each slot frees after outputTokens steps shared by the
    # maxNumSeqs running sequences, so the wait is 2 * 100 * 0.01 / 4.
    store.in_flight[full.id] = 5
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 0.5)
    assert scorer.predict_ttft_s(request, free) == pytest.approx(base)
    assert scores(scorer, store, request) == pytest.approx([base / (base + 0.5), 1.0])
    # Once requests have ended there, their measured duration replaces outputTokens steps.
    store.request_done(full.id, 2.0)
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 2 * 2.0 / 4)
    # Off (0): in-flight requests cost nothing beyond their queued prefill.
    off = PredictedLatencyScorer(
        "p", dataclasses.replace(params, maxNumSeqs=0), make_context(store)
    )
    assert off.predict_ttft_s(request, full) == pytest.approx(base)


def test_predicted_latency_slot_wait_by_age_waits_for_the_oldest_request() -> None:
    # slotWait: ages: the request past the cap waits until the in-flight request picked first
    # is expected to end (its pick + the requests' lifetime), not one lifetime / maxNumSeqs.
    clock = ManualClock(100.0)
    store = make_store(2, clock=clock)
    full, free = store.all()
    params = slot_params(maxNumSeqs=4, slotWait="ages")
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    uniform = PredictedLatencyScorer(
        "p", dataclasses.replace(params, slotWait="uniform"), make_context(store)
    )
    request = make_request("x" * 4 * 1_000)  # 0.1 s of prefill, one 0.01 s step
    base = 0.1 + 0.01
    store.request_done(full.id, 10.0)  # requests here last 10 s
    # Four requests picked together 1 s ago fill the engine: the next slot frees in 9 s.
    store.picked_s[full.id].extend([99.0] * 4)
    store.in_flight[full.id] = 4
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 9.0)
    assert uniform.predict_ttft_s(request, full) == pytest.approx(base + 10.0 / 4)
    # Picked in turn over the last 10 s: the oldest is about to end.
    store.picked_s[full.id][:] = [90.5, 93.0, 95.5, 98.0]
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 0.5)
    # Two past the cap: the second oldest.
    store.picked_s[full.id].append(99.5)
    store.in_flight[full.id] = 5
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 3.0)
    # Requests this picker did not pick there (another worker's) are spread over a lifetime.
    store.picked_s[full.id][:] = [99.0]
    store.in_flight[full.id] = 4  # three unknown: 10/3, 20/3 and 10 s left
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 10.0 / 3)
    # More waiting than running: the four running end in 5 s, the next four in line take their
    # slots for a whole lifetime, and this request waits for one of those.
    store.picked_s[full.id][:] = [95.0] * 4 + [99.5] * 5
    store.in_flight[full.id] = 9
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 5.0 + 10.0)
    assert scorer.predict_ttft_s(request, free) == pytest.approx(base)


def test_predicted_latency_slot_wait_by_age_before_any_request_has_ended() -> None:
    # With no lifetime measured yet, requests last longer than the oldest in flight has run,
    # and it is taken to run as long again: outputTokens steps would call it done already.
    clock = ManualClock(100.0)
    store = make_store(1, clock=clock)
    (full,) = store.all()
    params = slot_params(maxNumSeqs=2, outputTokens=100, slotWait="ages")  # 100 steps: 1 s
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    request = make_request("x" * 4 * 1_000)
    base = 0.1 + 0.01
    store.picked_s[full.id].extend([99.8, 99.9])
    store.in_flight[full.id] = 2
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 0.8)  # 1 s from 99.8
    clock.advance(3.0)  # 3.2 s in flight and not ended: 3.2 s more
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 3.2)
    guess = PredictedLatencyScorer(
        "p", dataclasses.replace(params, slotColdAgeFactor=0), make_context(store)
    )
    assert guess.predict_ttft_s(request, full) == pytest.approx(base)  # 1 s from 99.8: past
    store.request_done(full.id, 4.0)  # once one has ended, its lifetime is measured
    assert scorer.predict_ttft_s(request, full) == pytest.approx(base + 0.8)


def test_predicted_latency_slot_wait_cold_ages_reads_ages_until_a_request_has_ended() -> None:
    # slotWait: cold-ages: the ages while nothing has ended on the endpoint (a burst that filled
    # it together), the uniform formula once a request's duration there is measured.
    clock = ManualClock(100.0)
    store = make_store(2, clock=clock)
    cold, warm = store.all()
    params = slot_params(maxNumSeqs=2, outputTokens=100, slotWait="cold-ages")  # 100 steps: 1 s
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    request = make_request("x" * 4 * 1_000)
    base = 0.1 + 0.01
    for endpoint in (cold, warm):
        store.picked_s[endpoint.id].extend([97.0, 99.0])
        store.in_flight[endpoint.id] = 2
    store.request_done(warm.id, 8.0)
    # Cold: 3 s in flight and not ended, so 6 s in all: 3 s left for the oldest.
    assert scorer.predict_ttft_s(request, cold) == pytest.approx(base + 3.0)
    # Warm: one slot frees every 8 s / 2, whatever the picks' ages.
    assert scorer.predict_ttft_s(request, warm) == pytest.approx(base + 8.0 / 2)
    ages = PredictedLatencyScorer(
        "p", dataclasses.replace(params, slotWait="ages"), make_context(store)
    )
    assert ages.predict_ttft_s(request, warm) == pytest.approx(base + 5.0)  # 97 + 8 - 100


def cached_on_first_of(*classes: str, **params: float):  # type: ignore[no-untyped-def]
    """A store of ``classes``, linear-only latency parameters at 10,000 prefill tokens/s (plus
    ``params``), and a 10,000-token request the first endpoint holds whole."""
    store = classed(*classes)
    latency = PredictedLatencyParams(
        prefillTokensPerSecond=10_000, attentionCrossoverTokens=0, **params
    )
    request = make_request("x" * 4 * 10_000)  # 10,000 tokens
    request.state[PREFIX_MATCH] = PrefixMatch(16, 625, {store.all()[0].id: 625})
    return store, latency, request


def test_predicted_latency_decode_tokens_counts_the_request_own_decode_steps() -> None:
    # decodeTokens adds the request's first output tokens, each step reading the KV in flight
    # on the endpoint plus its own prompt, at the class's decode speed: a holder of the context
    # that is busy decoding long contexts stops looking free.
    store, params, request = cached_on_first_of(
        "H100", "H100", "L4", stepSeconds=0.01, kvReadTokensPerSecond=1_000_000, chunkTokens=100_000
    )
    holder, idle, slow = store.all()
    store.in_flight_tokens[holder.id] = 190_000  # 0.2 s per step there
    ttft = PredictedLatencyScorer("p", params, make_context(store))
    assert ttft.predict_ttft_s(request, holder) == pytest.approx(0.2)
    assert ttft.predict_ttft_s(request, idle) == pytest.approx(1.0 + 0.01)
    assert scores(ttft, store, request)[0] == 1.0
    with_decode = PredictedLatencyScorer(
        "p", dataclasses.replace(params, decodeTokens=10), make_context(store)
    )
    # holder: 0.2 + 10 * (0.01 + 200,000 / 1e6); idle: 1.01 + 10 * (0.01 + 10,000 / 1e6)
    assert with_decode.predict_ttft_s(request, holder) == pytest.approx(0.2 + 2.1)
    assert with_decode.predict_ttft_s(request, idle) == pytest.approx(1.01 + 0.2)
    # An L4 prefills at its prefill speed and takes each step at its decode speed.
    l4 = BUILTIN_HARDWARE_CLASSES["L4"]
    assert with_decode.predict_ttft_s(request, slow) == pytest.approx(
        1.0 / l4.prefill_speed + 0.01 / l4.decode_speed + 10 * (0.01 + 0.01) / l4.decode_speed
    )
    out = scores(with_decode, store, request)
    assert out[1] == 1.0 and out[0] == pytest.approx(1.21 / 2.3)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("decodeTokens", -1),
        ("decodeTokens", "many"),
        ("decodeMinPromptTokens", -1),
        ("decodeExcess", "yes"),
        ("missCost", -0.1),
        ("missCost", "high"),
        ("saturatedMissCost", -1),
        ("missExcess", "yes"),
        ("saturatedAbove", -1),
        ("saturatedQueue", "median"),
        ("saturatedQueue", 2),
        ("ownWaitingAtScrape", "yes"),
        ("decodeShortTokens", -1),
        ("decodeShortTokens", "some"),
        ("queueProgress", -0.5),
        ("queueProgress", 1.5),
        ("queueProgress", "half"),
        ("prefillCalibration", "yes please"),
        ("calibrationMinTokens", 0),
        ("calibrationMinTokens", 1.5),
        ("calibrationSteps", "some"),
        ("calibrationFit", "linear"),
        ("blockingCost", -1),
        ("blockingWindowSeconds", 0),
        ("slotWait", "oldest"),
        ("slotWait", 1),
        ("slotColdAgeFactor", -1),
    ],
)
def test_predicted_latency_rejects_a_bad_value(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        decode(PredictedLatencyParams, {name: value}, "parameters")


def test_predicted_latency_miss_cost_prices_the_wait_a_miss_imposes_on_its_endpoint() -> None:
    # missCost adds missCost * I(e) * own_work_s(e) to the ranking: every request in flight on
    # an endpoint waits while a miss there is computed. A holder with a short queue keeps the
    # request once the batch a miss elsewhere would slow is large enough.
    # 10,000 tokens, 1 s to compute on an H100; all cached on the first.
    store, params, request = cached_on_first_of(
        "H100", "H100", "L4", stepSeconds=0, kvReadTokensPerSecond=0
    )
    holder, busy, slow = store.all()
    store.add_prefill(holder.id, 15_000)  # 1.5 s queued on the holder
    store.in_flight[busy.id] = 40
    store.in_flight[slow.id] = 40
    plain = PredictedLatencyScorer("p", params, make_context(store))
    assert [plain.own_work_s(request, e) for e in (holder, busy)] == pytest.approx([0.0, 1.0])
    l4 = BUILTIN_HARDWARE_CLASSES["L4"]
    assert plain.own_work_s(request, slow) == pytest.approx(1.0 / l4.prefill_speed)
    # Alone, the first token is sooner on the endpoint that computes it all (1 s against 1.5 s).
    assert scores(plain, store, request)[1] == 1.0
    priced = PredictedLatencyScorer(
        "p", dataclasses.replace(params, missCost=0.05), make_context(store)
    )
    out = scores(priced, store, request)
    # busy: 1 + 0.05 * 40 * 1 = 3 s against the holder's 1.5 s.
    assert out[0] == 1.0 and out[1] == pytest.approx(1.5 / 3.0)
    assert out[2] == pytest.approx(1.5 / ((1.0 + 0.05 * 40 * 1.0) / l4.prefill_speed))
    # Nothing in flight: nothing to slow, the plain estimate.
    store.in_flight[busy.id] = store.in_flight[slow.id] = 0
    assert scores(priced, store, request) == pytest.approx(scores(plain, store, request))
    # A request computed on a prefill endpoint (remotePrefillTokens) costs a decode endpoint
    # no prefill.
    remote = PredictedLatencyScorer(
        "p", dataclasses.replace(params, remotePrefillTokens=1000), make_context(store)
    )
    assert remote.own_work_s(request, busy) == 0.0


def test_predicted_latency_saturated_miss_cost_prices_a_miss_only_once_every_queue_is_busy() -> (
    None
):
    # 10,000 tokens, 1 s to compute on an H100; all cached on the first. 1.5 s queued on the
    # holder, 0.2 s on the other two: alone, the estimate moves the request.
    store, params, request = cached_on_first_of(
        "H100", "H100", "H100", stepSeconds=0, kvReadTokensPerSecond=0
    )
    holder, second, third = store.all()
    store.add_prefill(holder.id, 15_000)
    store.add_prefill(second.id, 2_000)
    plain = PredictedLatencyScorer("p", params, make_context(store))
    priced = PredictedLatencyScorer(
        "p", dataclasses.replace(params, saturatedMissCost=1.0), make_context(store)
    )
    # The third endpoint has nothing queued: below saturation, the plain estimate.
    assert scores(priced, store, request) == pytest.approx(scores(plain, store, request))
    assert scores(plain, store, request) == pytest.approx([1.0 / 1.5, 1.0 / 1.2, 1.0])
    store.add_prefill(third.id, 2_000)
    store.add_prefill(holder.id, 0)  # two queued on the holder; one on each of the others
    # Every endpoint has a queue (the fewest: 1): a miss costs its prefill once more.
    out = scores(priced, store, request)
    # holder 1.5 s; the others 0.2 + 1 + 1 * 1 * 1 = 2.2 s.
    assert out[0] == 1.0 and out[1] == pytest.approx(1.5 / 2.2)
    # Without the option the same queues move it: 1.2 s elsewhere against the holder's 1.5 s.
    assert scores(plain, store, request) == pytest.approx([1.2 / 1.5, 1.0, 1.0])
    # saturatedAbove 1 counts only the requests waiting behind the prefill being computed:
    # with one queued on each of the others, none waits, and the plain estimate ranks.
    above = PredictedLatencyScorer(
        "p",
        dataclasses.replace(params, saturatedMissCost=1.0, saturatedAbove=1),
        make_context(store),
    )
    assert scores(above, store, request) == pytest.approx(scores(plain, store, request))
    for endpoint in (second, third):
        store.add_prefill(endpoint.id, 0)  # a second one queued behind each
    # Now one waits everywhere (q = 2 - 1): the others 0.2 + 1 + 1 * 1 * 1 = 2.2 s.
    assert scores(above, store, request) == pytest.approx([1.0, 1.5 / 2.2, 1.5 / 2.2])


def test_predicted_latency_saturated_queue_mean_prices_a_miss_by_the_pool_s_queues() -> None:
    # saturatedQueue: mean counts q as the candidates' mean queued prefills, not the fewest:
    # one idle endpoint next to long queues no longer makes a miss free.
    # 10,000 tokens, 1 s to compute on an H100; all cached on the first.
    store, params, request = cached_on_first_of(
        "H100", "H100", "H100", stepSeconds=0, kvReadTokensPerSecond=0
    )
    holder, second, _ = store.all()
    for _ in range(3):
        store.add_prefill(holder.id, 5_000)  # three queued on the holder: 1.5 s
    for _ in range(3):
        store.add_prefill(second.id, 5_000)
    fewest = dataclasses.replace(params, saturatedMissCost=1.0, missExcess=True)
    mean = dataclasses.replace(fewest, saturatedQueue="mean")
    plain = PredictedLatencyScorer("p", params, make_context(store))
    by_fewest = PredictedLatencyScorer("p", fewest, make_context(store))
    by_mean = PredictedLatencyScorer("p", mean, make_context(store))
    # The idle endpoint has no queue, so the fewest is 0: the plain estimate moves the request
    # there (1 s against the holder's 1.5 s).
    assert scores(plain, store, request) == pytest.approx([1.0 / 1.5, 1.0 / 2.5, 1.0])
    assert scores(by_fewest, store, request) == pytest.approx(scores(plain, store, request))
    # The mean is 2 queued: the idle endpoint costs 1 + 1 * 2 * 1 = 3 s, the second
    # 1.5 + 1 + 2 = 4.5 s, and the holder, which computes nothing, keeps its 1.5 s.
    assert scores(by_mean, store, request) == pytest.approx([1.0, 1.5 / 4.5, 1.5 / 3.0])
    # saturatedAbove lowers the mean as it does the fewest (2 - 1 = 1): the idle endpoint
    # 1 + 1 = 2 s, the second 1.5 + 1 + 1 = 3.5 s.
    above = PredictedLatencyScorer(
        "p", dataclasses.replace(mean, saturatedAbove=1), make_context(store)
    )
    assert scores(above, store, request) == pytest.approx([1.0, 1.5 / 3.5, 1.5 / 2.0])


def test_predicted_latency_miss_excess_prices_only_the_work_beyond_the_best_cached() -> None:
    # Past saturation (every endpoint has one prefill queued), a prompt held by the first
    # endpoint: in excess, the holder adds nothing and the others their whole prefill, as
    # without it. Held by nobody: as is, every candidate's cost grows by the same second and
    # the ratios move toward 1; in excess, the ranking is the plain estimate's.
    store, params, request = cached_on_first_of(
        "H100", "H100", "H100", stepSeconds=0, kvReadTokensPerSecond=0
    )
    holder, second, third = store.all()
    for endpoint, tokens in ((holder, 15_000), (second, 2_000), (third, 4_000)):
        store.add_prefill(endpoint.id, tokens)
    as_is = dataclasses.replace(params, saturatedMissCost=1.0)
    excess = dataclasses.replace(as_is, missExcess=True)
    plain = PredictedLatencyScorer("p", params, make_context(store))
    added = PredictedLatencyScorer("p", as_is, make_context(store))
    beyond = PredictedLatencyScorer("p", excess, make_context(store))
    # Held by the first: costs 1.5 / 2.2 / 2.4 s either way (its own miss costs 0 there).
    assert scores(beyond, store, request) == pytest.approx(scores(added, store, request))
    assert scores(beyond, store, request) == pytest.approx([1.0, 1.5 / 2.2, 1.5 / 2.4])
    request.state[PREFIX_MATCH] = PrefixMatch(16, 625, {})  # held by nobody
    # Plain: 2.5 / 1.2 / 1.4 s; as is, one second more each: 3.5 / 2.2 / 2.4 s.
    assert scores(plain, store, request) == pytest.approx([1.2 / 2.5, 1.0, 1.2 / 1.4])
    assert scores(added, store, request) == pytest.approx([2.2 / 3.5, 1.0, 2.2 / 2.4])
    assert scores(beyond, store, request) == pytest.approx(scores(plain, store, request))


def test_predicted_latency_own_waiting_at_scrape_matches_the_count_to_its_own_time() -> None:
    # The scraped waiting count stays until the next scrape; the picker's own queue moves on.
    # ownWaitingAtScrape subtracts the own requests queued when the scrape was recorded.
    store = make_store(2)
    finished, routed = store.all()
    plain, at_scrape = linear_latency(), linear_latency(ownWaitingAtScrape=True)
    now = PredictedLatencyScorer("p", plain, make_context(store))
    then = PredictedLatencyScorer("p", at_scrape, make_context(store))
    request = make_request("x" * 400)  # 100 tokens: 0.1 s anywhere
    # An own request was waiting when the scrape was taken, and has its first byte since.
    store.add_prefill(finished.id, 1000)
    store.update_metrics(finished.id, waiting=1, running=0, kv_usage=0)
    assert store.scraped_prefill_requests[finished.id] == 1
    store.prefill_done(finished.id, 1000)
    assert now.predict_ttft_s(request, finished) == pytest.approx(0.1 + 0.5)  # the phantom
    assert then.predict_ttft_s(request, finished) == pytest.approx(0.1)
    # Somebody else's request was waiting at the scrape; an own one was routed since, which
    # the count cannot include yet.
    store.update_metrics(routed.id, waiting=1, running=0, kv_usage=0)
    store.add_prefill(routed.id, 1000)
    assert now.predict_ttft_s(request, routed) == pytest.approx(1.0 + 0.1)  # hidden
    assert then.predict_ttft_s(request, routed) == pytest.approx(1.0 + 0.1 + 0.5)
    # The next scrape sees the own request routed since and nothing else.
    for endpoint in (finished, routed):
        store.update_metrics(endpoint.id, waiting=endpoint is routed, running=0, kv_usage=0)
    assert store.scraped_prefill_requests == [0, 1]
    for scorer in (now, then):
        assert [scorer.predict_ttft_s(request, e) for e in (finished, routed)] == pytest.approx(
            [0.1, 1.1]
        )
    # An endpoint that takes a removed one's id starts with no own requests at a scrape.
    store.set_endpoints([EndpointSpec(finished.address)])
    store.set_endpoints([EndpointSpec(finished.address), EndpointSpec("10.0.0.9:8000")])
    assert store.by_address["10.0.0.9:8000"].id == routed.id
    assert store.scraped_prefill_requests[routed.id] == 0


def test_predicted_latency_queue_progress_counts_the_head_of_the_queue_as_partly_done() -> None:
    # queueProgress p takes p * (time since the head of an endpoint's queue started) off its
    # queued prefill, at the class's prefill speed, at most the mean queued request's share.
    clock = ManualClock()
    store = make_store(3, labels=[{HARDWARE_CLASS_LABEL: c} for c in ("H100", "H100", "L4")],
                       clock=clock)  # fmt: skip
    holder, idle, slow = store.all()
    plain = PredictedLatencyScorer("p", linear_latency(), make_context(store))
    full = PredictedLatencyScorer("p", linear_latency(queueProgress=1), make_context(store))
    half = PredictedLatencyScorer("p", linear_latency(queueProgress=0.5), make_context(store))
    request = make_request("x" * 400)  # 100 tokens: 0.1 s on an H100
    assert store.prefill_head_s == [-1.0, -1.0, -1.0]
    store.add_prefill(holder.id, 4000)  # 4 s of prefill, started now
    assert store.prefill_head_s[holder.id] == clock()
    clock.advance(1.0)
    store.add_prefill(holder.id, 2000)  # queued behind it: the head is unchanged
    assert store.prefill_head_s[holder.id] == clock() - 1.0
    # 6 s queued; one second of it done, at most 3 s (the mean request's share).
    assert plain.predict_ttft_s(request, holder) == pytest.approx(6.1)
    assert full.predict_ttft_s(request, holder) == pytest.approx(5.1)
    assert half.predict_ttft_s(request, holder) == pytest.approx(5.6)
    clock.advance(9.0)  # long past its estimate: still no more than its share comes off
    assert full.predict_ttft_s(request, holder) == pytest.approx(3.1)
    assert half.predict_ttft_s(request, holder) == pytest.approx(3.1)
    # Its prefill ends: the next request is at the head from now, its whole work queued.
    store.prefill_done(holder.id, 4000)
    assert store.prefill_head_s[holder.id] == clock()
    assert full.predict_ttft_s(request, holder) == pytest.approx(2.1)
    clock.advance(0.5)
    assert full.predict_ttft_s(request, holder) == pytest.approx(1.6)
    store.prefill_done(holder.id, 2000)
    assert store.prefill_head_s[holder.id] == -1.0
    assert full.predict_ttft_s(request, holder) == pytest.approx(0.1)
    # An empty queue, or one whose head's start this store never saw (another worker's
    # requests, set directly), has nothing taken off.
    store.prefill_tokens[idle.id], store.prefill_requests[idle.id] = 1000.0, 1
    assert full.predict_ttft_s(request, idle) == plain.predict_ttft_s(request, idle) == 1.1
    # A slower class computes less of its queue in the same time.
    l4 = BUILTIN_HARDWARE_CLASSES["L4"]
    store.add_prefill(slow.id, 1000)
    clock.advance(1.0)
    assert full.predict_ttft_s(request, slow) == pytest.approx(
        (1000 - 1000 * l4.prefill_speed + 100) / 1000 / l4.prefill_speed
    )
    # The ranking follows: a holder part-way through a long prefill beats an idle endpoint
    # that would compute the document again.
    store.prefill_tokens[idle.id], store.prefill_requests[idle.id] = 0.0, 0
    document = make_request("x" * 4 * 3000)  # 3,000 tokens, all but 100 queued at the holder
    store.add_prefill(holder.id, 2900)
    document.state[PREFIX_MATCH] = PrefixMatch(16, 187, {holder.id: 181})
    clock.advance(2.0)
    assert scores(plain, store, document)[:2] == pytest.approx([3.0 / (2.9 + 0.104), 1.0])
    assert scores(full, store, document)[:2] == pytest.approx([1.0, (0.9 + 0.104) / 3.0])


def busy_holder():  # type: ignore[no-untyped-def]
    """Two H100s, the first holding the 10,000-token request whole and decoding 190,000 prompt
    tokens in flight, the second idle; 0.01 s steps reading 1M KV tokens per second (so a
    decode step of that request takes 0.21 s on the holder and 0.02 s on the idle one)."""
    store, params, request = cached_on_first_of(
        "H100", "H100", stepSeconds=0.01, kvReadTokensPerSecond=1_000_000, chunkTokens=100_000
    )
    holder, idle = store.all()
    store.in_flight_tokens[holder.id] = 190_000
    return store, params, request, holder, idle


def test_predicted_latency_decode_excess_counts_what_exceeds_the_least_and_long_prompts_only() -> (
    None
):
    # The same holder and idle endpoint: 0.2 s per step on the holder, 0.01 s on the idle one.
    store, params, request, holder, idle = busy_holder()
    decode10 = dataclasses.replace(params, decodeTokens=10)
    # As is: holder 0.2 + 2.1, idle 1.01 + 0.2 (the previous test).
    assert scores(
        PredictedLatencyScorer("p", decode10, make_context(store)), store, request
    ) == pytest.approx([1.21 / 2.3, 1.0])
    # decodeExcess: the ranking adds only what exceeds the least of the candidates' terms, so
    # holder 0.2 + (2.1 - 0.2), idle 1.01 + 0; the estimate itself stops at the first token.
    excess = PredictedLatencyScorer(
        "p", dataclasses.replace(decode10, decodeExcess=True), make_context(store)
    )
    assert excess.predict_ttft_s(request, holder) == pytest.approx(0.2)
    assert excess.decode_s(request, holder) == pytest.approx(2.1)
    assert excess.decode_s(request, idle) == pytest.approx(0.2)
    assert scores(excess, store, request) == pytest.approx([1.01 / 2.1, 1.0])
    # decodeMinPromptTokens: the term counts for prompts of at least that many tokens (this
    # one has 10,000), whether as is or in excess.
    for extra in ({}, {"decodeExcess": True}):
        at = dataclasses.replace(decode10, decodeMinPromptTokens=10_000, **extra)
        above = dataclasses.replace(decode10, decodeMinPromptTokens=10_001, **extra)
        assert scores(
            PredictedLatencyScorer("p", at, make_context(store)), store, request
        ) == pytest.approx([1.01 / 2.1, 1.0] if extra else [1.21 / 2.3, 1.0])
        short = PredictedLatencyScorer("p", above, make_context(store))
        assert short.predict_ttft_s(request, holder) == pytest.approx(0.2)
        assert scores(short, store, request) == pytest.approx([1.0, 0.2 / 1.01])


def test_predicted_latency_decode_short_tokens_counts_short_prompts_fewer_steps() -> None:
    # decodeShortTokens: a prompt shorter than decodeMinPromptTokens counts that many of its
    # first decode steps where it counted none; a longer one keeps decodeTokens.
    store, params, request, holder, idle = busy_holder()
    # This 10,000-token prompt is short for decodeMinPromptTokens 10,001. Each decode step:
    # holder 0.01 + 200,000 / 1M = 0.21 s, idle 0.01 + 10,000 / 1M = 0.02 s.
    short = dataclasses.replace(
        params, decodeTokens=10, decodeMinPromptTokens=10_001, decodeShortTokens=5
    )
    scorer = PredictedLatencyScorer("p", short, make_context(store))
    assert scorer.decode_s(request, holder) == pytest.approx(5 * 0.21)
    assert scorer.decode_s(request, idle) == pytest.approx(5 * 0.02)
    # As is: holder 0.2 + 1.05, idle 1.01 + 0.1.
    assert scores(scorer, store, request) == pytest.approx([1.11 / 1.25, 1.0])
    # In excess: holder 0.2 + (1.05 - 0.1), idle 1.01 + 0.
    excess = PredictedLatencyScorer(
        "p", dataclasses.replace(short, decodeExcess=True), make_context(store)
    )
    assert excess.predict_ttft_s(request, holder) == pytest.approx(0.2)
    assert scores(excess, store, request) == pytest.approx([1.01 / 1.15, 1.0])
    # A prompt at decodeMinPromptTokens keeps decodeTokens (10 steps: holder 2.1, idle 0.2).
    long = PredictedLatencyScorer(
        "p",
        dataclasses.replace(short, decodeMinPromptTokens=10_000, decodeExcess=True),
        make_context(store),
    )
    assert scores(long, store, request) == pytest.approx([1.01 / 2.1, 1.0])
    # Without decodeMinPromptTokens every prompt is long: the option would do nothing.
    with pytest.raises(ConfigError, match="decodeShortTokens needs decodeMinPromptTokens"):
        make_scheduler(
            one_scorer_document("predicted-latency-scorer", {"decodeShortTokens": 8}),
            make_store(2),
        )


def test_predicted_latency_decode_bound_term_only_while_every_candidate_reads_more_kv() -> None:
    # decodeBoundTokens: while every candidate's decode steps read more KV than weights (in-flight
    # prompt tokens of at least stepSeconds * kvReadTokensPerSecond, 10,000 here), the decode
    # term counts that many output tokens from decodeBoundMinPromptTokens; otherwise
    # decodeTokens from decodeMinPromptTokens, as before.
    store, params, request, holder, idle = busy_holder()
    bound = dataclasses.replace(
        params,
        decodeTokens=10,
        decodeMinPromptTokens=20_000,  # above this 10,000-token prompt: the term is off
        decodeExcess=True,
        decodeBoundTokens=30,
        decodeBoundMinPromptTokens=5_000,
    )
    scorer = PredictedLatencyScorer("p", bound, make_context(store))
    plain = PredictedLatencyScorer(
        "p",
        dataclasses.replace(bound, decodeBoundTokens=0, decodeBoundMinPromptTokens=0),
        make_context(store),
    )
    # The idle endpoint reads no KV: not decode-bound, so the request's term is off as before.
    assert scorer.decode_terms(store.all()) == (10, 20_000)
    assert scores(scorer, store, request) == scores(plain, store, request)
    assert scores(scorer, store, request) == pytest.approx([1.0, 0.2 / 1.01])
    # At exactly the bound on the other (0.02 s steps there): 30 tokens from 5,000, each step
    # on the holder 0.18 s longer, so holder 0.2 + 30 * 0.18, the other 1.0 + 0.02 + 0.
    store.in_flight_tokens[idle.id] = 10_000
    assert scorer.decode_terms(store.all()) == (30, 5_000)
    assert scorer.decode_terms([holder]) == (30, 5_000)
    assert scores(scorer, store, request) == pytest.approx([1.02 / (0.2 + 30 * 0.18), 1.0])
    assert scores(plain, store, request) == pytest.approx([1.0, 0.2 / 1.02])
    # Just below it, off again; and a prompt below decodeBoundMinPromptTokens has none.
    store.in_flight_tokens[idle.id] = 9_999
    assert scores(scorer, store, request) == scores(plain, store, request)
    store.in_flight_tokens[idle.id] = 10_000
    longer = PredictedLatencyScorer(
        "p", dataclasses.replace(bound, decodeBoundMinPromptTokens=10_001), make_context(store)
    )
    assert scores(longer, store, request) == scores(plain, store, request)


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        ({"decodeBoundTokens": 96}, "decodeBoundTokens needs decodeExcess"),
        (
            {"decodeBoundTokens": 96, "decodeExcess": True, "kvReadTokensPerSecond": 0},
            "decodeBoundTokens needs kvReadTokensPerSecond",
        ),
        (
            {"decodeBoundMinPromptTokens": 8192},
            "decodeBoundMinPromptTokens needs decodeBoundTokens",
        ),
    ],
)
def test_predicted_latency_decode_bound_without_what_it_needs_is_a_config_error(
    parameters: dict[str, object], match: str
) -> None:
    # Each would load and change nothing; the config is refused with the reason instead.
    with pytest.raises(ConfigError, match=match):
        make_scheduler(one_scorer_document("predicted-latency-scorer", parameters), make_store(2))


def test_predicted_latency_prefill_calibration_scales_prefill_by_the_observed_prefills() -> None:
    # With prefillCalibration the prefill seconds (own and queued, and the miss costs' work)
    # are multiplied by the observed prefills' measured seconds over what the estimate gives
    # their work; the steps and other terms are not. A 70B model at tensor parallel 4 prefills
    # about three times slower than the 8B constants say, and a move that computes a long
    # context again costs that much more against a busy holder's decode.
    clock = ManualClock()
    store = make_store(2, labels=[{HARDWARE_CLASS_LABEL: c} for c in ("H100", "L4")], clock=clock)
    h100, l4 = store.all()
    params = linear_latency(stepSeconds=0.01)
    plain = PredictedLatencyScorer("p", params, make_context(store))
    learned = PredictedLatencyScorer(
        "p", dataclasses.replace(params, prefillCalibration=True), make_context(store)
    )
    request = make_request("x" * 4 * 1000)  # 1,000 tokens: 1 s of prefill, one step
    assert plain.predict_ttft_s(request, h100) == pytest.approx(1.01)

    def observe(endpoint, tokens: float, seconds: float) -> None:  # type: ignore[no-untyped-def]
        store.add_prefill(endpoint.id, tokens)
        clock.advance(seconds)
        store.prefill_done(endpoint.id, tokens, observed=True)

    for _ in range(3):
        observe(h100, 5000.0, 15.0)  # three times the 5 s the constants give
    assert learned.prefill_scale() == 1.0  # too few samples yet
    assert learned.predict_ttft_s(request, h100) == pytest.approx(1.01)
    # The L4's own samples count at its class's speed: this one is as slow as the H100's.
    l4_speed = BUILTIN_HARDWARE_CLASSES["L4"].prefill_speed
    observe(l4, 5000.0, 15.0 / l4_speed)
    assert learned.prefill_scale() == pytest.approx(3.0)
    assert learned.predict_ttft_s(request, h100) == pytest.approx(3.01)
    assert learned.own_work_s(request, h100) == pytest.approx(3.0)
    store.add_prefill(l4.id, 2000.0)  # queued work is scaled too, the step is not
    step_s = 0.01 / BUILTIN_HARDWARE_CLASSES["L4"].decode_speed
    assert learned.predict_ttft_s(request, l4) == pytest.approx(3.0 * 3.0 / l4_speed + step_s)
    assert plain.predict_ttft_s(request, h100) == pytest.approx(1.01)  # off: unchanged
    # The factor is on /metrics while the option is on.
    assert [(g.name, g.value) for g in learned.collect_metrics()] == [
        ("kv_picker_prefill_calibration_ratio", pytest.approx(3.0))
    ]
    assert list(plain.collect_metrics()) == []
    # The factor follows the samples kept, within [0.25, 8] whatever they say.
    for _ in range(PREFILL_SAMPLES):
        observe(h100, 5000.0, 500.0)
    assert learned.prefill_scale() == 8.0
    for _ in range(PREFILL_SAMPLES):
        observe(h100, 5000.0, 0.01)
    assert learned.prefill_scale() == 0.25


def test_predicted_latency_calibration_from_shorter_prefills_and_without_their_steps() -> None:
    # calibrationMinTokens lowers the shortest prefill kept as a sample (the store's floor,
    # 4,096 tokens by default: a pool of 3,000-token prompts otherwise never calibrates), and
    # a scorer sharing the store with the default minimum still reads only the longer ones.
    # calibrationSteps takes the engine steps the prefill took, as the estimate prices them,
    # off its measured seconds: the factor is then the prompt's compute alone.
    clock = ManualClock()
    store = make_store(1, clock=clock)
    (h100,) = store.all()
    params = linear_latency(stepSeconds=0.05, kvReadTokensPerSecond=100_000, chunkTokens=1000,
                            prefillCalibration=True)  # fmt: skip
    default = PredictedLatencyScorer("p", params, make_context(store))
    assert store.prefill_sample_min_tokens == 4096  # the default leaves the floor
    short = PredictedLatencyScorer(
        "p", dataclasses.replace(params, calibrationMinTokens=1000), make_context(store)
    )
    steps = PredictedLatencyScorer(
        "p",
        dataclasses.replace(params, calibrationMinTokens=1000, calibrationSteps=True),
        make_context(store),
    )
    assert store.prefill_sample_min_tokens == 1000
    store.in_flight_tokens[h100.id] = 5000.0  # each step: 0.05 s + 5,000 tokens at 100,000/s

    def observe(tokens: float, seconds: float) -> None:
        store.add_prefill(h100.id, tokens)
        clock.advance(seconds)
        store.prefill_done(h100.id, tokens, observed=True)

    for _ in range(4):
        observe(2000.0, 6.2)  # 2 s of work at the constants, two steps of 0.1 s: 3x the work
    assert default.prefill_scale() == 1.0  # none long enough for it
    assert short.prefill_scale() == pytest.approx(3.1)
    assert steps.prefill_scale() == pytest.approx(3.0)
    for _ in range(4):
        observe(5000.0, 15.5)  # five steps: 0.5 s of them
    assert default.prefill_scale() == pytest.approx(3.1)
    assert short.prefill_scale() == pytest.approx((4 * 6.2 + 4 * 15.5) / (4 * 2 + 4 * 5))
    assert steps.prefill_scale() == pytest.approx(3.0)


def test_predicted_latency_calibration_fits_linear_attention_and_steps_apart() -> None:
    # calibrationFit: terms learns a factor each for the linear, attention and step seconds:
    # a 70B model at tensor parallel 4 is about three times the 8B constants' linear cost but
    # not their attention cost, so one factor learned from short prompts misprices long ones.
    # Here the engine is 3x the linear, 1.5x the attention and 2x the step constants.
    clock = ManualClock()
    store = make_store(1, clock=clock)
    (h100,) = store.all()
    params = linear_latency(attentionCrossoverTokens=1000, stepSeconds=0.05, chunkTokens=4096,
                            prefillCalibration=True, calibrationMinTokens=1000)  # fmt: skip
    terms = PredictedLatencyScorer(
        "p", dataclasses.replace(params, calibrationFit="terms"), make_context(store)
    )
    ratio = PredictedLatencyScorer("p", params, make_context(store))

    def engine_s(tokens: int) -> float:  # a fresh prompt: tokens^2 / 2 attention pairs
        linear = tokens / 1000
        attention = tokens * tokens / 2 / 1e6
        return 3.0 * linear + 1.5 * attention + 2.0 * math.ceil(tokens / 4096) * 0.05

    def observe(tokens: int) -> None:
        store.add_prefill(h100.id, tokens, tokens * tokens / 2)
        clock.advance(engine_s(tokens))
        store.prefill_done(h100.id, tokens, tokens * tokens / 2, observed=True)

    for _ in range(2):
        observe(2000)  # prompts of one length: the terms cannot be told apart
    for _ in range(2):
        observe(2000)
    one_length = terms.calibration()
    # So it is one ratio: measured over the constants' 2 s linear, 2 s attention, 0.05 s step.
    assert one_length == pytest.approx((engine_s(2000) / 4.05,) * 3)
    short, long = make_request("x" * 4 * 2000), make_request("x" * 4 * 8000)
    assert terms.predict_ttft_s(short, h100) == pytest.approx(engine_s(2000))
    for tokens in (1000, 4000, 8000, 1000, 4000, 8000):
        observe(tokens)
    assert terms.calibration() == pytest.approx((3.0, 1.5, 2.0), rel=1e-4)
    # Prefills computed in the same engine steps end together: the second is timed from the
    # first's end, at nothing, and joins its sample (here 3,000 tokens in one step).
    for _ in range(4):
        store.add_prefill(h100.id, 2000, 2000 * 2000 / 2)
        store.add_prefill(h100.id, 1000, 1000 * 1000 / 2)
        clock.advance(3.0 * 3 + 1.5 * (2.0 + 0.5) + 2.0 * 0.05)
        store.prefill_done(h100.id, 2000, 2000 * 2000 / 2, observed=True)
        store.prefill_done(h100.id, 1000, 1000 * 1000 / 2, observed=True)
    assert store.prefill_samples[-1].seconds == 0.0
    assert terms.calibration() == pytest.approx((3.0, 1.5, 2.0), rel=1e-4)
    # One that ended with a prefill too short to be a sample has none to join: left out.
    for _ in range(4):
        store.add_prefill(h100.id, 500, 500 * 500 / 2)
        store.add_prefill(h100.id, 1000, 1000 * 1000 / 2)
        clock.advance(1.0)
        store.prefill_done(h100.id, 500, 500 * 500 / 2, observed=True)
        store.prefill_done(h100.id, 1000, 1000 * 1000 / 2, observed=True)
    assert terms.calibration() == pytest.approx((3.0, 1.5, 2.0), rel=1e-4)
    for request, tokens in ((short, 2000), (long, 8000)):
        steps_s = math.ceil(tokens / 4096) * 0.05
        assert terms.own_work_s(request, h100) == pytest.approx(engine_s(tokens) - 2.0 * steps_s)
        assert terms.predict_ttft_s(request, h100) == pytest.approx(engine_s(tokens), rel=1e-4)
    # One factor on all of it (calibrationFit: ratio, the steps unscaled), learned mostly from
    # the long prompts' attention, prices the short prompt well below its cost.
    assert ratio.predict_ttft_s(short, h100) < 0.9 * engine_s(2000)
    # The decode term keeps its constants: what it ranks by, the KV read of the decodes on a
    # holder, scales unlike an engine step's fixed cost, which is most of what the fit sees.
    decoding = PredictedLatencyScorer(
        "p",
        dataclasses.replace(params, calibrationFit="terms", decodeTokens=10),
        make_context(store),
    )
    assert decoding.decode_s(short, h100) == pytest.approx(10 * 0.05)
    # Until a request has ended on the endpoint, the slot term reads a request's length as
    # outputTokens steps each as the samples show a step (2x the constant here).
    slots = dataclasses.replace(params, maxNumSeqs=1, outputTokens=10)
    store.in_flight[h100.id] = 1  # one in flight: the next waits for its slot
    for fit, step_factor in (("terms", 2.0), ("ratio", 1.0)):
        with_slot = PredictedLatencyScorer(
            "p", dataclasses.replace(slots, calibrationFit=fit), make_context(store)
        )
        without = PredictedLatencyScorer(
            "p", dataclasses.replace(params, calibrationFit=fit), make_context(store)
        )
        assert with_slot.predict_ttft_s(short, h100) - without.predict_ttft_s(
            short, h100
        ) == pytest.approx(10 * 0.05 * step_factor, rel=1e-4)
    store.in_flight[h100.id] = 0
    assert [(g.name, g.value) for g in terms.collect_metrics()] == [
        ("kv_picker_prefill_calibration_ratio", pytest.approx(3.0, rel=1e-4)),
        ("kv_picker_prefill_calibration_attention_ratio", pytest.approx(1.5, rel=1e-4)),
        ("kv_picker_prefill_calibration_step_ratio", pytest.approx(2.0, rel=1e-4)),
    ]
    # A prefill with others queued behind it shared its steps with their chunks: while enough
    # prefills ended alone in the queue, only those count (here it also waited on something
    # the picker did not send, 10 s; the one behind it is timed right from its end).
    scale = ratio.prefill_scale()
    for _ in range(4):
        store.add_prefill(h100.id, 2000, 2000 * 2000 / 2)
        store.add_prefill(h100.id, 4000, 4000 * 4000 / 2)
        clock.advance(engine_s(2000) + 10.0)
        store.prefill_done(h100.id, 2000, 2000 * 2000 / 2, observed=True)
        clock.advance(engine_s(4000))
        store.prefill_done(h100.id, 4000, 4000 * 4000 / 2, observed=True)
    assert [sample.queued for sample in list(store.prefill_samples)[-2:]] == [2, 1]
    assert terms.calibration() == pytest.approx((3.0, 1.5, 2.0), rel=1e-4)
    assert ratio.prefill_scale() > scale  # one ratio counts them all
    # Within [0.25, 8] like the one ratio: a factor past a bound is held there and the others
    # fitted again, so the samples' seconds are still matched as well as the bound allows.
    rows = [(20.0 * n + n * n / 1e4 + 1.0, n, n * n / 1e4, 1.0) for n in (1.0, 2.0, 4.0, 8.0)]
    linear, attention, step = fit_terms(rows)
    assert linear == 8.0
    assert attention > 1.0 and step > 1.0  # they take up what the linear term cannot
    assert fit_terms([(1.0, 0.0, 0.0, 0.0)]) == (1.0, 1.0, 1.0)  # no work estimated: as is


def test_predicted_latency_blocking_cost_prices_the_wait_of_requests_arriving_meanwhile() -> None:
    # blockingCost b adds b x (the requests this picker sent the candidate per second lately,
    # a count decayed over blockingWindowSeconds) x (its prefill seconds of this request)^2 / 2,
    # in excess of the least: what the requests arriving while the prefill runs wait for it.
    clock = ManualClock()
    store = make_store(3, clock=clock)
    busy, quiet, idle = store.all()
    params = linear_latency(blockingCost=1.0)
    scorer = PredictedLatencyScorer("p", params, make_context(store))
    plain = PredictedLatencyScorer("p", linear_latency(), make_context(store))
    document = make_request("x" * 4 * 2000)  # 2,000 tokens cached nowhere: 2 s anywhere

    def sent(endpoint, count: int) -> None:  # type: ignore[no-untyped-def]
        for _ in range(count):
            result = ProfileResult([endpoint], [endpoint], [1.0])
            scorer.on_pick(make_request(), SchedulingResult("default", {"default": result}))

    sent(busy, 10)
    sent(quiet, 1)
    assert scorer.arrival_rate(busy) == pytest.approx(1.0)  # 10 picks over a 10 s window
    assert scorer.arrival_rate(quiet) == pytest.approx(0.1)
    assert scorer.arrival_rate(idle) == 0.0
    # The idle endpoint adds nothing, the busy one 1.0 x 2^2 / 2 = 2 s, the quiet one 0.2 s.
    assert scores(scorer, store, document) == pytest.approx([2.0 / 4.0, 2.0 / 2.2, 1.0])
    assert scores(plain, store, document) == [1.0, 1.0, 1.0]
    # A question whose document the busy endpoint holds costs it nothing to compute there,
    # so it stays: the others would add their own prefill's cost.
    question = make_request("x" * 4 * 2000)
    question.state[PREFIX_MATCH] = PrefixMatch(16, 500, {busy.id: 500})
    out = scores(scorer, store, question)
    assert out[0] == 1.0 and out[1] < out[2] < 0.01
    # The count decays: after one window, e^-1 of it.
    clock.advance(10.0)
    assert scorer.arrival_rate(busy) == pytest.approx(math.exp(-1.0))
    # An id freed by a removed endpoint and given to a new one starts from nothing.
    store.set_endpoints([EndpointSpec("10.0.0.2:8000"), EndpointSpec("10.0.0.3:8000")])
    store.set_endpoints(
        [EndpointSpec(a) for a in ("10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.9:8000")]
    )
    newcomer = store.get(busy.id)
    assert newcomer is not None and newcomer is not busy
    assert scorer.arrival_rate(newcomer) == 0.0


def test_predicted_latency_blocking_unsaturated_drops_the_blocking_cost_past_saturation() -> None:
    # blockingUnsaturated counts the blocking cost only while saturatedMissCost's q is 0: past
    # saturation that term prices the same wait by the backlog.
    clock = ManualClock()
    store = make_store(2, clock=clock)
    busy, idle = store.all()
    both = linear_latency(blockingCost=1.0, blockingUnsaturated=True, saturatedAbove=1)
    scorer = PredictedLatencyScorer("p", both, make_context(store))
    always = PredictedLatencyScorer(
        "p", dataclasses.replace(both, blockingUnsaturated=False), make_context(store)
    )
    plain = PredictedLatencyScorer("p", linear_latency(saturatedAbove=1), make_context(store))
    document = make_request("x" * 4 * 2000)  # 2,000 tokens cached nowhere: 2 s anywhere
    for _ in range(10):
        result = ProfileResult([busy], [busy], [1.0])
        scorer.on_pick(make_request(), SchedulingResult("default", {"default": result}))
        always.on_pick(make_request(), SchedulingResult("default", {"default": result}))
    # No queue anywhere (q = 0 - 1): the busy endpoint adds 1.0 x 2^2 / 2 = 2 s, as without
    # the option.
    assert scorer.saturation([busy, idle]) == -1
    assert scores(scorer, store, document) == pytest.approx([2.0 / 4.0, 1.0])
    assert scores(always, store, document) == pytest.approx([2.0 / 4.0, 1.0])
    # One prefill computing on each (q = 0): still unsaturated.
    store.add_prefill(busy.id, 1000)
    store.add_prefill(idle.id, 1000)
    assert scorer.saturation([busy, idle]) == 0
    assert scores(scorer, store, document) == pytest.approx(scores(always, store, document))
    assert scores(scorer, store, document) != pytest.approx(scores(plain, store, document))
    # A second one waiting on each (q = 1): the blocking cost is off, the plain estimate ranks.
    store.add_prefill(busy.id, 1000)
    store.add_prefill(idle.id, 1000)
    assert scorer.saturation([busy, idle]) == 1
    assert scores(scorer, store, document) == pytest.approx(scores(plain, store, document))
    assert scores(always, store, document) != pytest.approx(scores(plain, store, document))
