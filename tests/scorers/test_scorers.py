from collections import Counter

import pytest

from kv_picker.decode import decode
from kv_picker.endpoint import EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.scheduling.framework import PeerPick, ProfileResult, SchedulingResult
from kv_picker.scheduling.signals import (
    PREFIX_MATCH,
    PrefixMatch,
    cached_tokens,
    uncached_prompt_tokens,
)
from kv_picker.scorers.kv_cache_utilization import (
    KVCacheUtilizationParams,
    KVCacheUtilizationScorer,
)
from kv_picker.scorers.prefix_cache import Landings, PrefixCacheParams, PrefixCacheScorer
from kv_picker.scorers.queue import QueueParams, QueueScorer, RunningRequestsScorer
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


def scores(scorer, store, request=None) -> list[float]:  # type: ignore[no-untyped-def]
    out = [0.0] * len(store.all())
    scorer.score(request or make_request(), store.all(), out)
    return out


def test_running_requests_min_max_reads_the_running_gauge() -> None:
    store = make_store(3, waiting=[9, 0, 0], running=[1, 3, 5])
    scorer = RunningRequestsScorer("r", QueueParams(), make_context(store))
    assert scores(scorer, store) == [1.0, 0.5, 0.0]


def test_queue_min_max() -> None:
    store = make_store(4, waiting=[0, 2, 4, 4])
    assert scores(QueueScorer("q", QueueParams(), make_context(store)), store) == [
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    equal = make_store(3, waiting=[3, 3, 3])
    assert scores(QueueScorer("q", QueueParams(), make_context(equal)), equal) == [1.0] * 3


def test_stale_metrics_count_as_loaded() -> None:
    clock = ManualClock()
    store = make_store(2, waiting=[0, 0], kv_usage=[0.1, 0.1], clock=clock)
    clock.advance(5.0)
    store.update_metrics(store.all()[1].id, waiting=3, running=0, kv_usage=0.5)
    ctx = make_context(store)
    assert scores(QueueScorer("q", QueueParams(), ctx), store) == [0.0, 1.0]
    kv = KVCacheUtilizationScorer("k", KVCacheUtilizationParams(), ctx)
    assert scores(kv, store) == pytest.approx([0.0, 0.5])


def test_kv_utilization() -> None:
    store = make_store(3, kv_usage=[0.0, 0.25, 1.0])
    scorer = KVCacheUtilizationScorer("k", KVCacheUtilizationParams(), make_context(store))
    assert scores(scorer, store) == pytest.approx([1.0, 0.75, 0.0])


def test_prefix_scores_matched_over_total_after_pick() -> None:
    store = make_store(3)
    scorer = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(store))
    first = make_request("a" * 100)  # 10 blocks
    assert scores(scorer, store, first) == [0.0, 0.0, 0.0]
    target = store.all()[1]
    result = SchedulingResult("default", {"default": ProfileResult([target], store.all(), [])})
    scorer.on_pick(first, result)
    half = make_request("a" * 50 + "b" * 50)
    assert scores(scorer, store, half) == [0.0, 0.5, 0.0]
    salted = make_request("a" * 100, cache_salt="other-tenant")
    assert scores(scorer, store, salted) == [0.0, 0.0, 0.0]
    other_model = make_request("a" * 100, model="m2")
    assert scores(scorer, store, other_model) == [0.0, 0.0, 0.0]


def test_prefix_match_length_weight_mixes_in_the_matched_tokens() -> None:
    # llm-d's form: w * min(1, matched tokens / scale)^2 + (1 - w) * matched / total.
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=40, matchLengthWeight=0.5, matchLengthScaleTokens=40)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    long_holder, short_holder = store.all()[0], store.all()[1]
    for prompt, holder in (("a" * 400, long_holder), ("a" * 80 + "c" * 320, short_holder)):
        request = make_request(prompt)
        scores(scorer, store, request)
        scorer.on_pick(
            request, SchedulingResult("default", {"default": ProfileResult([holder], [], [])})
        )
    # 10 blocks of 10 tokens; the first holds 8 of them (80 tokens), the second 2 (20 tokens).
    probe = make_request("a" * 320 + "b" * 80)
    assert scores(scorer, store, probe) == pytest.approx(
        [0.5 * 1.0 + 0.5 * 0.8, 0.5 * 0.5**2 + 0.5 * 0.2, 0.0]
    )


def test_prefix_affinity_through_scheduler() -> None:
    store = make_store(4)
    scheduler = make_scheduler({}, store, seed=3)
    shared = "system prompt for group A. " * 40
    picks = {
        scheduler.schedule(make_request(shared + f"question {i}"), store.all())
        .primary.targets[0]
        .address
        for i in range(10)
    }
    assert len(picks) == 1


def test_default_profile_spreads_requests_sharing_only_a_first_block() -> None:
    # The Mooncake conversation trace: every request starts with the same block, then differs.
    # With requests in flight, the default profile must not pin them all on one endpoint. The
    # director does the accounting the scorers read (prefill queued until the first byte, prompt
    # tokens in flight until the end); prompts are long enough for in-flight spreading to count.
    director = make_director({}, store=make_store(4))
    counts: Counter[str] = Counter()
    in_flight = []
    for i in range(400):
        prompt = "S" * 64 + f"session-{i}-" + "x" * 24000
        routed = director.route(make_request(prompt, request_id=f"r{i}"))
        in_flight.append(routed)
        counts[routed.endpoint.address] += 1
        if len(in_flight) > 8:  # requests complete after a while, oldest first
            done = in_flight.pop(0)
            done.first_byte()
            done.finish()
    assert len(counts) == 4
    assert max(counts.values()) < 0.4 * 400


def test_default_profile_sees_a_long_cached_context_as_cached() -> None:
    # An agent's 25,000-token context, cached where its previous turn ran. The latency estimate
    # takes cached tokens from the prefix match; matching only the upstream 256 blocks (about
    # 4,000 tokens) made the holding endpoint look nearly as slow as an empty one.
    director = make_director({}, store=make_store(4))
    context = "".join(f"step {i}: tool output {i * 7919 % 10007}. " for i in range(3600))
    assert len(context) > 100_000
    first = director.route(make_request(context, request_id="turn-1"))
    first.first_byte()
    first.finish()
    routed = director.route(
        make_request(context + " next step?", request_id="turn-2"), None, explain=True
    )
    assert routed.endpoint is first.endpoint
    assert routed.result is not None
    result = routed.result.profile_results["default"]
    assert result.breakdown is not None
    latency = result.breakdown["predicted-latency-scorer"]
    holder = result.candidates.index(first.endpoint)
    assert latency[holder] == 1.0
    # Elsewhere the whole context is prefill: many times slower than the suffix alone.
    assert max(s for i, s in enumerate(latency) if i != holder) < 0.1, latency
    # Explaining keeps the prefix match the scorers read, though the routed request dropped it.
    assert routed.request.state == {}
    assert routed.result.signals is not None
    match = routed.result.signals[PREFIX_MATCH]
    assert isinstance(match, PrefixMatch)
    assert match.cached_tokens(first.endpoint.id) > 20_000
    assert all(match.cached_tokens(e.id) == 0 for e in result.candidates if e is not first.endpoint)
    plain = director.route(make_request(context + " again?", request_id="turn-3"))
    assert plain.result is not None and plain.result.signals is None


@pytest.mark.parametrize(
    ("chars", "capped"),
    [(10 * 4, False), (10 * 4 + 9, False), (10 * 5, True), (10 * 50, True), (10 * 3, False)],
)
def test_prefix_match_says_when_the_prompt_goes_on_past_the_blocks_looked_up(
    chars: int, capped: bool
) -> None:
    """With at most 4 blocks of 10 characters looked up, a prompt with a fifth full block is
    capped (the match cannot see it); one that ends inside the fourth or fifth block is not."""
    store = make_store(2)
    params = PrefixCacheParams(blockSizeChars=10, maxPrefixBlocksToMatch=4)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    request = make_request("a" * chars)
    scorer.score(request, store.all(), [0.0, 0.0])
    match = request.state[PREFIX_MATCH]
    assert isinstance(match, PrefixMatch)
    assert match.total_blocks == min(4, chars // 10)
    assert match.capped is capped


@pytest.mark.parametrize("whole", [False, True])
def test_capped_match_is_whole_publishes_a_full_capped_match_as_the_whole_prompt(
    whole: bool,
) -> None:
    """Looking up at most 4 blocks of 10 characters (2.5 tokens each at 4 characters a token),
    an endpoint holding a 500-character prompt matches all 4; with ``cappedMatchIsWhole`` every
    reader of the match sees it holding all 125 tokens, while a shorter match, or a prompt that
    ends within the limit, counts block by block either way."""
    store = make_store(3)
    params = PrefixCacheParams(
        blockSizeChars=10, maxPrefixBlocksToMatch=4, cappedMatchIsWhole=whole
    )
    scorer = PrefixCacheScorer("p", params, make_context(store))
    endpoints = store.all()
    for target, text in ((endpoints[1], "a" * 500), (endpoints[2], "a" * 20 + "z" * 480)):
        held = make_request(text)
        scores(scorer, store, held)
        scorer.on_pick(
            held, SchedulingResult("default", {"default": ProfileResult([target], endpoints, [])})
        )
    request = make_request("a" * 500)
    assert scores(scorer, store, request) == [0.0, 1.0, 0.5]  # the score does not change
    held_tokens = [cached_tokens(request, e.id) for e in endpoints]
    assert held_tokens == [0.0, 125.0 if whole else 10.0, 5.0]
    assert uncached_prompt_tokens(request, endpoints[1].id) == (0.0 if whole else 115.0)
    short = make_request("a" * 40)  # 4 blocks and nothing past them: not capped
    scores(scorer, store, short)
    assert cached_tokens(short, endpoints[1].id) == 10.0


@pytest.mark.parametrize("value", ["maybe", 1, None])
def test_capped_match_is_whole_takes_only_a_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match=r"parameters\.cappedMatchIsWhole: expected true/false"):
        decode(PrefixCacheParams, {"cappedMatchIsWhole": value}, "parameters")


def _pd_result(decode, prefill) -> SchedulingResult:  # type: ignore[no-untyped-def]
    return SchedulingResult(
        "decode",
        {"decode": ProfileResult([decode], [], []), "prefill": ProfileResult([prefill], [], [])},
        prefill_profile="prefill",
    )


def test_a_pd_destination_holds_the_prompt_once_its_kv_has_landed() -> None:
    store = make_store(3)
    scorer = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(store))
    prefill, decode, other = store.all()
    first = make_request("a" * 100, request_id="first")
    result = _pd_result(decode, prefill)
    scorer.on_pick(first, result)
    # The prefill endpoint computes it now; the destination has nothing until the KV lands.
    assert scores(scorer, store, make_request("a" * 100)) == [1.0, 0.0, 0.0]
    scorer.on_prompt_landed(first, result)
    assert scores(scorer, store, make_request("a" * 100)) == [1.0, 1.0, 0.0]
    scorer.index.remove_endpoint(decode.id)
    scorer.on_prompt_landed(first, result)  # once only: a second call records nothing
    assert scorer.index.held(decode.id) == []
    # A destination that left before its KV landed is not recorded (its id may be reused).
    second = make_request("b" * 100, request_id="second")
    scorer.on_pick(second, _pd_result(other, prefill))
    store.set_endpoints(
        EndpointSpec(a) for a in ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.9:8000")
    )
    newcomer = store.by_address["10.0.0.9:8000"]
    assert newcomer.id == other.id  # the id is reused
    scorer.on_prompt_landed(second, _pd_result(other, prefill))
    assert scores(scorer, store, make_request("b" * 100)) == [1.0, 0.0, 0.0]


def test_pd_requests_sharing_a_request_id_land_each_on_its_own() -> None:
    """A client may send one x-request-id twice (a retry while the first is in flight): the
    first landing records its own destination only."""
    store = make_store(3)
    scorer = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(store))
    prefill, decode, other = store.all()
    first, retry = make_request("a" * 100, request_id="r"), make_request("b" * 100, request_id="r")
    scorer.on_pick(first, _pd_result(decode, prefill))
    scorer.on_pick(retry, _pd_result(other, prefill))
    scorer.on_prompt_landed(first, _pd_result(decode, prefill))
    assert scores(scorer, store, make_request("a" * 100)) == [1.0, 1.0, 0.0]
    assert scores(scorer, store, make_request("b" * 100)) == [1.0, 0.0, 0.0]  # not landed
    scorer.on_prompt_landed(retry, _pd_result(other, prefill))
    assert scores(scorer, store, make_request("b" * 100)) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("at", ["landed", "pick"])
def test_another_workers_pd_pick_records_its_destination_as_its_own_would(at: str) -> None:
    """serve --workers: a peer's disaggregated pick records the prefill endpoint at once and
    the destination when the peer says the prompt landed, as this worker's own picks do."""
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=10, recordDestinationAt=at)  # type: ignore[arg-type]
    scorer = PrefixCacheScorer("p", params, make_context(store))
    prefill, decode, other = store.all()
    keys = scorer.keys(make_request("a" * 100))
    scorer.record_peer_pick(PeerPick(decode.id, prefill.id, "0/7/r1"), keys)
    before = [1.0, 0.0 if at == "landed" else 1.0, 0.0]
    assert scores(scorer, store, make_request("a" * 100)) == before
    scorer.record_peer_landing("0/7/r2")  # another request's landing changes nothing
    assert scores(scorer, store, make_request("a" * 100)) == before
    scorer.record_peer_landing("0/7/r1")
    assert scores(scorer, store, make_request("a" * 100)) == [1.0, 1.0, 0.0]
    # A destination this worker does not know: the prefill endpoint is still recorded.
    more = scorer.keys(make_request("b" * 100))
    scorer.record_peer_pick(PeerPick(None, other.id, "0/7/r3"), more)
    scorer.record_peer_landing("0/7/r3")
    assert scores(scorer, store, make_request("b" * 100)) == [0.0, 0.0, 1.0]
    # A pick without a landing to wait for (its destination computes the prompt) records it.
    third = scorer.keys(make_request("c" * 100))
    scorer.record_peer_pick(PeerPick(other.id), third)
    assert scores(scorer, store, make_request("c" * 100)) == [0.0, 0.0, 1.0]


def test_pd_landings_are_bounded_oldest_first() -> None:
    landings = Landings(capacity=2)
    endpoint = make_store(1).all()[0]
    for name in ("a", "b", "c"):
        landings.expect(name, endpoint, [1])
    assert len(landings) == 2
    assert landings.take("a") is None  # the oldest was forgotten
    assert landings.take("c") == (endpoint, [1]) and landings.take("c") is None


def test_removed_endpoint_leaves_the_prefix_index() -> None:
    store = make_store(2)
    scorer = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(store))
    request = make_request("a" * 100)
    target = store.all()[0]
    scorer.on_pick(request, SchedulingResult("d", {"d": ProfileResult([target], [], [])}))
    assert len(scorer.index) == 10
    store.set_endpoints([])
    assert len(scorer.index) == 0


def test_a_prefix_scorers_state_and_peer_picks_carry_over_by_address() -> None:
    """What serve --workers sends between workers: a pick's keys, and a whole copy."""
    store = make_store(3)
    source = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(store))
    request = make_request("a" * 100)
    scores(source, store, request)
    keys = source.pick_keys(request)
    assert keys is not None and len(keys) == 10
    source.record_peer_pick(PeerPick(store.all()[2].id), keys)
    addresses = {e.id: e.address for e in store.all()}
    state = source.export_state(addresses)
    assert state == {store.all()[2].address: list(keys)}

    other = make_store(3)  # the same addresses
    copy = PrefixCacheScorer("p", PrefixCacheParams(blockSizeChars=10), make_context(other))
    ids = {address: e.id for address, e in other.by_address.items()}
    assert copy.import_state({**state, "10.9.9.9:1": [1, 2]}, ids) == 10  # unknown: skipped
    assert scores(copy, other, make_request("a" * 100)) == [0.0, 0.0, 1.0]


def _held_at(scorer: PrefixCacheScorer, store, placed) -> None:  # type: ignore[no-untyped-def]
    """Record each (endpoint, prompt) pick of ``placed`` with the scorer, as the picker does."""
    for target, prompt in placed:
        held = make_request(prompt)
        scores(scorer, store, held)
        scorer.on_pick(
            held,
            SchedulingResult("default", {"default": ProfileResult([target], store.all(), [])}),
        )


@pytest.mark.parametrize("least", [0, 100, 1000])
def test_pending_yield_tokens_stops_a_queued_copy_drawing_requests_from_a_holder(
    least: int,
) -> None:
    """Endpoints 1 and 2 both match a 400-character prompt (100 tokens at 4 characters a
    token); endpoint 2 still has 150 tokens of prefill queued, enough to be computing it. With
    ``pendingYieldTokens`` at most 100 it scores 0 while endpoint 1 holds as much with nothing
    queued; above the match, or off, both score 1. With no settled holder, the queued copy
    keeps its score."""
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=10, pendingYieldTokens=least)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    endpoints = store.all()
    _held_at(scorer, store, [(endpoints[1], "a" * 400), (endpoints[2], "a" * 400)])
    store.add_prefill(endpoints[2].id, 150.0)
    request = make_request("a" * 400)
    yields = least == 100
    assert scores(scorer, store, request) == [0.0, 1.0, 0.0 if yields else 1.0]
    assert cached_tokens(request, endpoints[2].id) == 100.0  # the published match is unchanged
    store.add_prefill(endpoints[1].id, 120.0)  # now both may be computing it
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 1.0, 1.0]
    store.prefill_done(endpoints[1].id, 120.0)
    store.prefill_done(endpoints[2].id, 150.0)
    store.add_prefill(endpoints[2].id, 90.0)  # 90 queued: less than the match
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("ratio", "held_tokens", "yields"),
    [
        (0.0, 90_000.0, True),  # off: the queued copy yields whatever the holder decodes
        (2.0, 50_000.0, True),  # the holder decodes at most twice the copy's 30,000 tokens
        (2.0, 60_000.0, True),  # exactly twice
        (2.0, 70_000.0, False),  # more than twice: the copy keeps its score
        (1.0, 40_000.0, False),
    ],
)
def test_pending_yield_decode_keeps_a_queued_copy_where_the_holder_decodes_more(
    ratio: float, held_tokens: float, yields: bool
) -> None:
    """Endpoint 1 holds a 400-character prompt with nothing queued; endpoint 2 holds it with
    150 tokens of prefill queued and 30,000 prompt tokens in flight. With
    ``pendingYieldDecode`` the copy yields only while the holder's tokens in flight are at most
    that many times its own."""
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=10, pendingYieldTokens=100, pendingYieldDecode=ratio)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    endpoints = store.all()
    _held_at(scorer, store, [(endpoints[1], "a" * 400), (endpoints[2], "a" * 400)])
    store.add_prefill(endpoints[2].id, 150.0)
    store.in_flight_tokens[endpoints[2].id] = 30_000.0
    store.in_flight_tokens[endpoints[1].id] = held_tokens
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 1.0, 0.0 if yields else 1.0]


def test_a_queued_copy_does_not_yield_to_a_holder_that_matches_less() -> None:
    """Endpoint 1 holds only the first half of the prompt, with nothing queued; endpoint 2
    holds all of it with its prefill queued: it keeps its score, since the settled holder
    would compute the rest again."""
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=10, pendingYieldTokens=40)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    endpoints = store.all()
    _held_at(scorer, store, [(endpoints[1], "a" * 200), (endpoints[2], "a" * 400)])
    store.add_prefill(endpoints[2].id, 150.0)
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("cap", [0, 4, 5])
def test_full_yield_stops_a_hit_drawing_requests_to_an_engine_with_every_slot_taken(
    cap: int,
) -> None:
    """Endpoints 1 and 2 hold the prompt; endpoint 2 has 4 requests in flight. With
    ``fullYield`` 4 it scores 0 while another candidate has a slot free; off, or at 5, it
    keeps its score. Once every candidate is full, the scores stand."""
    store = make_store(3)
    scorer = PrefixCacheScorer(
        "p", PrefixCacheParams(blockSizeChars=10, fullYield=cap), make_context(store)
    )
    endpoints = store.all()
    _held_at(scorer, store, [(endpoints[1], "a" * 400), (endpoints[2], "a" * 400)])
    store.in_flight[endpoints[2].id] = 4
    request = make_request("a" * 400)
    assert scores(scorer, store, request) == [0.0, 1.0, 0.0 if cap == 4 else 1.0]
    assert cached_tokens(request, endpoints[2].id) == 100.0  # the published match is unchanged
    # The only holder full: an endpoint holding nothing has a slot, so the hit yields.
    store.in_flight[endpoints[1].id] = 4
    assert scores(scorer, store, make_request("a" * 400)) == (
        [0.0, 0.0, 0.0] if cap == 4 else [0.0, 1.0, 1.0]
    )
    store.in_flight[endpoints[0].id] = 4  # every candidate full
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(("free", "yields"), [(1, True), (3, True), (4, False)])
def test_full_yield_free_yields_only_to_a_candidate_with_room(free: int, yields: bool) -> None:
    """Endpoint 2 holds the prompt with its 8 slots taken; endpoint 0, holding nothing, has 5
    in flight (3 free). The hit yields only while a candidate has ``fullYieldFree`` free."""
    store = make_store(3)
    params = PrefixCacheParams(blockSizeChars=10, fullYield=8, fullYieldFree=free)
    scorer = PrefixCacheScorer("p", params, make_context(store))
    endpoints = store.all()
    _held_at(scorer, store, [(endpoints[2], "a" * 400)])
    store.in_flight[endpoints[0].id] = 5
    store.in_flight[endpoints[1].id] = 8
    store.in_flight[endpoints[2].id] = 8
    assert scores(scorer, store, make_request("a" * 400)) == [0.0, 0.0, 0.0 if yields else 1.0]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"fullYieldFree": 8}, "fullYieldFree needs fullYield"),
        ({"fullYield": 64, "fullYieldFree": 0}, "fullYieldFree"),
        ({"pendingYieldDecode": 2}, "pendingYieldDecode needs pendingYieldTokens"),
        ({"recordDestinationAt": "soon"}, "recordDestinationAt"),
    ],
)
def test_prefix_cache_rejects_bad_yield_parameters(
    parameters: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_scheduler(one_scorer_document("prefix-cache-scorer", parameters), make_store(2))


def test_pending_yield_decode_counts_tokens_in_flight_per_decode_speed() -> None:
    """An L4 holder with a tenth of the copy's tokens in flight still decodes more slowly
    than the H100 computing the copy (about eleven times slower per token): at a ratio of 1
    the copy keeps its score; with the same tokens on an H100 holder it yields."""
    for holder, yields in (("L4", False), ("H100", True)):
        store = make_store(3, labels=[{HARDWARE_CLASS_LABEL: c} for c in ("H100", holder, "H100")])
        params = PrefixCacheParams(
            blockSizeChars=10, pendingYieldTokens=100, pendingYieldDecode=1.0
        )
        scorer = PrefixCacheScorer("p", params, make_context(store))
        endpoints = store.all()
        _held_at(scorer, store, [(endpoints[1], "a" * 400), (endpoints[2], "a" * 400)])
        store.add_prefill(endpoints[2].id, 150.0)
        store.in_flight_tokens[endpoints[2].id] = 30_000.0
        store.in_flight_tokens[endpoints[1].id] = 3_000.0
        expected = [0.0, 1.0, 0.0 if yields else 1.0]
        assert scores(scorer, store, make_request("a" * 400)) == expected, holder


def test_pending_yield_tokens_refuses_a_negative_value() -> None:
    with pytest.raises(ConfigError, match=r"parameters\.pendingYieldTokens"):
        decode(PrefixCacheParams, {"pendingYieldTokens": -1}, "parameters")
    with pytest.raises(ConfigError, match=r"parameters\.pendingYieldDecode"):
        decode(PrefixCacheParams, {"pendingYieldDecode": -0.5}, "parameters")
